//! `forkfleet cluster auth`: the nats-server permissions and the credentials of each role
//! ([`forkfleet::auth`]).

use super::*;
use forkfleet::auth::{self, AuthError, AuthPlan};

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Write the nats-server authorization block (auth.conf) that gives the coordinator,
    /// the workers, an admin and each client identity its permissions, an nkey seed per
    /// identity (mode 0600) and a forkfleet config file per identity. See docs/CLUSTER.md,
    /// "Security".
    Auth(AuthArgs),
    /// Make a token for the HTTP API (docs/HTTP.md): prints the token once (on stderr),
    /// and on stdout the `[http.tokens."NAME"]` entry (its SHA-256, never the token) for
    /// the coordinator's config or its tokens file.
    Token(TokenArgs),
}

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// Who the token is for: a user or a service (1 to 64 letters, digits, `_` or `-`).
    pub name: String,
    /// What it may do: read, write (includes read) or admin (includes write); repeat.
    #[arg(long = "scope", value_name = "SCOPE", default_value = "read", value_parser = ["read", "write", "admin"])]
    pub scopes: Vec<String>,
    /// Limit it to this budget account's forks (repeat); without, every account's.
    #[arg(long = "account", value_name = "ACCOUNT")]
    pub accounts: Vec<String>,
}

#[derive(Debug, Args)]
pub struct AuthArgs {
    /// The directory to write into (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A client identity (repeat for several): its user may call ff.api.client.<IDENTITY>
    /// only and read its own replies only.
    #[arg(long = "client", value_name = "IDENTITY")]
    pub clients: Vec<String>,
    /// A pool the workers pull from (repeat for several; default: default).
    #[arg(long = "pool", value_name = "NAME")]
    pub pools: Vec<String>,
    /// The NATS URL to write into the config files.
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Users with passwords instead of nkeys: write only auth.conf (mode 0600), each
    /// identity's password, or its bcrypt hash, read from DIR/<identity> (coordinator,
    /// worker, admin, client-<identity>). The Helm chart's NATS pod does this (ADR 44).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["url", "tls_names"])]
    pub passwords_from: Option<PathBuf>,
    /// The NATS server's name as clients reach it (a DNS name or an IP address; repeat):
    /// also make the certificates of mutual TLS (a CA, the server's for these names, one
    /// per identity), tls.conf for the server, and [nats.tls] in each config file.
    #[arg(long = "tls-name", value_name = "NAME")]
    pub tls_names: Vec<String>,
    /// When a previous run wrote every file, keep them and succeed (an init step run at
    /// every start, as compose's `auth` service).
    #[arg(long, conflicts_with = "force")]
    pub keep_existing: bool,
    /// Overwrite files a previous run wrote (new keys: every identity needs its new file).
    #[arg(long)]
    pub force: bool,
}

pub(crate) async fn cmd_cluster(command: ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Token(args) => {
            forkfleet_shared::subjects::check_identity(&args.name).map_err(|e| {
                BadInput(format!(
                    "token name `{}`: {e}; use 1 to 64 letters, digits, `_` or `-`",
                    args.name
                ))
            })?;
            for a in &args.accounts {
                forkfleet_shared::spec::check_account_name(a)
                    .map_err(|e| BadInput(format!("--account: {e}")))?;
            }
            let token = forkfleet::http_api::auth::new_token()?;
            let quoted = |v: &[String]| {
                v.iter()
                    .map(|s| format!("\"{s}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            // The token on stderr, the entry alone on stdout: `>> tokens.toml` makes a
            // tokens file ([http] tokens_file, e.g. the chart's Secret).
            eprintln!(
                "token for `{}` (shown once; keep it secret): {token}",
                args.name
            );
            eprintln!("add this entry to the coordinator's config file or its tokens_file:");
            println!("[http.tokens.\"{}\"]", args.name);
            println!(
                "sha256 = \"{}\"",
                hex::encode(forkfleet::http_api::auth::hash(&token))
            );
            println!("scopes = [{}]", quoted(&args.scopes));
            if !args.accounts.is_empty() {
                println!("accounts = [{}]", quoted(&args.accounts));
            }
            Ok(())
        }
        ClusterCommand::Auth(args) => {
            let plan = AuthPlan {
                clients: args.clients,
                pools: if args.pools.is_empty() {
                    vec![forkfleet_shared::protocol::DEFAULT_POOL.to_string()]
                } else {
                    args.pools
                },
                url: args.url,
                passwords_from: args.passwords_from,
                tls_names: args.tls_names,
                keep_existing: args.keep_existing,
            };
            let plan_has_passwords = plan.passwords_from.is_some();
            let files = auth::generate(&plan, &args.out, args.force).map_err(|e| match e {
                AuthError::Invalid(_) | AuthError::Exists(_) | AuthError::ReadPassword { .. } => {
                    anyhow::Error::new(BadInput(e.to_string()))
                }
                other => anyhow::Error::new(other),
            })?;
            if files.is_empty() {
                eprintln!(
                    "kept the files a previous run wrote in {} (--keep-existing)",
                    args.out.display()
                );
                return Ok(());
            }
            for f in files {
                println!("{}", f.display());
            }
            if plan_has_passwords {
                eprintln!(
                    "include {} in nats-server.conf; each identity logs in with its name and password",
                    args.out.join("auth.conf").display()
                );
            } else {
                eprintln!(
                    "include {} in nats-server.conf; give each process its .toml (--config) and .nk file",
                    args.out.join("auth.conf").display()
                );
            }
            Ok(())
        }
    }
}

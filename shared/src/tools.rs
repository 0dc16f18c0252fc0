//! The tools, declared once.
//!
//! [`TOOLS`] lists every tool a model may be offered: its name, whether a branch's
//! settings offer it, and which approval rules gate its calls. [`ToolSettings`] are the
//! spec's settings of the optional tools; they travel as one struct from the plan
//! (`ForkPlan::tools`) to every task (`BranchTask::tools`), flattened, so each setting
//! keeps its place in the spec, the plan and the wire. [`ToolSections`] is the spec's
//! `[tools]` table, where a tool's settings go (`[tools.http_get]`); `[run_command]`,
//! `forking` and `checkpoint_tools` predate it and stay where they were.
//!
//! What the model is told of a tool (its description and JSON schema) and how it runs
//! are the worker's: one file a tool under `worker/src/tools/`, registered in
//! `worker/src/tools.rs` (docs/ARCHITECTURE.md, "How to add a tool").
//!
//! A tool's settings are checked here twice over: as the spec writes them
//! ([`ToolSections::apply`]) and as a plan carries them ([`ToolSettings::check`]: a plan may
//! come over the API without a spec).

use crate::endpoint::{CommandTool, CommandToolSection};
use crate::spec::{CheckpointTools, SpecError};
use serde::{Deserialize, Serialize};

/// Which approval rules gate a tool's calls, besides naming it in `tools`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalClass {
    /// Only a rule naming the tool.
    Call,
    /// Also the `run_command` patterns, matched against its command line.
    Command,
    /// Also the `paths` patterns, matched against its `path` argument (it writes there).
    WritesPath,
}

/// What kind of tool a declaration is: where it runs and what offers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolKind {
    /// Offered to every branch, run by the worker over the overlay in memory (the file and
    /// search tools): nothing waits on it.
    Standard,
    /// Offered when a setting enables it, run by the worker (`run_command`, `http_get`).
    Optional,
    /// A fork tool (`forking = true`): run by the agent through the coordinator.
    Fork,
}

/// One tool's declaration.
#[derive(Debug, Clone, Copy)]
pub struct ToolDecl {
    pub name: &'static str,
    pub kind: ToolKind,
    /// Whether a branch with these settings is offered the tool.
    pub offered: fn(&ToolSettings) -> bool,
    /// What in a spec enables it (`""` for a standard tool), for the error a call of a
    /// tool that is not enabled gets.
    pub enabled_by: &'static str,
    pub approval: ApprovalClass,
}

const fn standard(name: &'static str, approval: ApprovalClass) -> ToolDecl {
    ToolDecl {
        name,
        kind: ToolKind::Standard,
        offered: |_| true,
        enabled_by: "",
        approval,
    }
}

const fn forking(name: &'static str) -> ToolDecl {
    ToolDecl {
        name,
        kind: ToolKind::Fork,
        offered: |s| s.forking,
        enabled_by: "`forking = true`",
        approval: ApprovalClass::Call,
    }
}

/// Every tool, in the order the model is told about them: the standard tools, then the
/// ones a setting enables. (The checkpoint tools, `checkpoint_tools = true`, are the
/// agent's own and no approval rule names them: they are not listed.)
pub const TOOLS: &[ToolDecl] = &[
    standard("read_file", ApprovalClass::Call),
    standard("write_file", ApprovalClass::WritesPath),
    standard("edit_file", ApprovalClass::WritesPath),
    standard("delete_file", ApprovalClass::WritesPath),
    standard("list_files", ApprovalClass::Call),
    standard("glob", ApprovalClass::Call),
    standard("grep", ApprovalClass::Call),
    ToolDecl {
        name: "run_command",
        kind: ToolKind::Optional,
        offered: |s| s.run_command.is_some(),
        enabled_by: "a `[run_command]` table",
        approval: ApprovalClass::Command,
    },
    ToolDecl {
        name: "http_get",
        kind: ToolKind::Optional,
        offered: |s| s.http_get.is_some(),
        enabled_by: "a `[tools.http_get]` table",
        approval: ApprovalClass::Call,
    },
    forking("fork_run"),
    forking("inspect_branches"),
    forking("merge_or_select"),
    forking("terminate_branch"),
    forking("diff_branches"),
    forking("fork_cost"),
];

/// The declaration of the tool named `name`.
pub fn decl(name: &str) -> Option<&'static ToolDecl> {
    TOOLS.iter().find(|t| t.name == name)
}

/// A tool a rule may name.
pub fn is_known(name: &str) -> bool {
    decl(name).is_some()
}

/// The names of the tools of `kind`, in order.
pub fn names_of(kind: ToolKind) -> Vec<&'static str> {
    TOOLS
        .iter()
        .filter(|t| t.kind == kind)
        .map(|t| t.name)
        .collect()
}

/// The standard tools' names, in order.
pub fn standard_names() -> Vec<&'static str> {
    names_of(ToolKind::Standard)
}

/// Whether `name` is a tool of `kind`.
pub fn is(kind: ToolKind, name: &str) -> bool {
    decl(name).is_some_and(|t| t.kind == kind)
}

/// Every tool's name, in order.
pub fn names() -> Vec<&'static str> {
    TOOLS.iter().map(|t| t.name).collect()
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The optional tools' settings a spec gives every branch of a fork.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolSettings {
    /// The `run_command` tool, when the spec's `[run_command]` table enables it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_command: Option<CommandTool>,
    /// The fork tools (`fork_run`, ...; `forking = true`): the agent's forks are created
    /// through the coordinator.
    #[serde(default, skip_serializing_if = "is_false")]
    pub forking: bool,
    /// The agent's checkpoint tools (`save_checkpoint`, `list_checkpoints`, `rewind_to`),
    /// with their descriptions as the spec overrides them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_tools: Option<CheckpointTools>,
    /// The `http_get` tool, when `[tools.http_get]` enables it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpGet>,
}

impl ToolSettings {
    /// Every setting valid, as the spec's checks would have it (a plan may come over the
    /// API without a spec).
    pub fn check(&self) -> Result<(), SpecError> {
        if let Some(tool) = &self.run_command {
            CommandToolSection::from_tool(tool)
                .validate()
                .map_err(SpecError::BadRunCommand)?;
        }
        if let Some(tools) = &self.checkpoint_tools {
            tools.check().map_err(|message| SpecError::BadCheckpoints {
                field: "tool_descriptions",
                message,
            })?;
        }
        if let Some(get) = &self.http_get {
            get.check().map_err(SpecError::BadTool)?;
        }
        Ok(())
    }

    /// The declared tools these settings offer, in order.
    pub fn offered(&self) -> impl Iterator<Item = &'static ToolDecl> + '_ {
        TOOLS.iter().filter(|t| (t.offered)(self))
    }
}

/// The spec's `[tools]` table: a table per tool that has settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSections {
    #[serde(default)]
    pub http_get: Option<HttpGetSection>,
}

impl ToolSections {
    /// Each section checked into its setting; an error names the key at fault and what
    /// is valid.
    pub fn apply(&self, settings: &mut ToolSettings) -> Result<(), String> {
        if let Some(section) = &self.http_get {
            settings.http_get = Some(section.build()?);
        }
        Ok(())
    }
}

/// `http_get` without `timeout_s`: 20 s.
pub const HTTP_GET_TIMEOUT_S: f64 = 20.0;
/// The longest `timeout_s`: 2 minutes.
pub const HTTP_GET_MAX_TIMEOUT_S: f64 = 120.0;
/// `http_get` without `max_bytes`: 20 kB of the body.
pub const HTTP_GET_MAX_BYTES: u32 = 20_000;
/// The largest `max_bytes`: 25 kB (a tool's whole answer is cut at 30,000 characters,
/// and the status line, the content type and the notice of a cut come first).
pub const HTTP_GET_MAX_MAX_BYTES: u32 = 25_000;

/// The `http_get` tool: fetch a URL on an allowed host (over `http` or `https`, following
/// redirects only to allowed hosts), its body as text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HttpGet {
    /// The hosts it may fetch from: `docs.rs`, `127.0.0.1:8080` (that port only), or
    /// `*.python.org` (any name under it, not `python.org` itself).
    pub allow: Vec<String>,
    pub timeout_s: f64,
    /// Bytes of the body read, at most; the rest is cut, and the model told.
    pub max_bytes: u32,
}

impl HttpGet {
    /// Valid as `[tools.http_get]` would have made it.
    pub fn check(&self) -> Result<(), String> {
        let built = HttpGetSection {
            allow: self.allow.clone(),
            timeout_s: Some(self.timeout_s),
            max_bytes: Some(self.max_bytes),
        }
        .build()?;
        if built != *self {
            return Err("`tools.http_get.allow` entries must be lowercase and trimmed".to_string());
        }
        Ok(())
    }

    /// Whether `host` (lowercase, as a URL names it; an IPv6 address without brackets)
    /// on `port` may be fetched. A wildcard matches names only, never an IP address.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let host = host.trim_end_matches('.');
        let is_ip = host.parse::<std::net::IpAddr>().is_ok();
        self.allow.iter().any(|a| {
            if let Some(domain) = a.strip_prefix("*.") {
                return !is_ip
                    && host
                        .strip_suffix(domain)
                        .is_some_and(|sub| sub.len() > 1 && sub.ends_with('.'));
            }
            split_entry(a).is_some_and(|(h, p)| h == host && p.is_none_or(|p| p == port))
        })
    }
}

/// `[tools.http_get]` as written in a spec.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpGetSection {
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub timeout_s: Option<f64>,
    #[serde(default)]
    pub max_bytes: Option<u32>,
}

impl HttpGetSection {
    /// The setting, checked.
    pub fn build(&self) -> Result<HttpGet, String> {
        if self.allow.is_empty() {
            return Err("`tools.http_get.allow` is empty: name the hosts it may fetch from (`docs.rs`, `127.0.0.1:8080`, `*.python.org`)".to_string());
        }
        let mut allow = Vec::with_capacity(self.allow.len());
        for entry in &self.allow {
            allow.push(check_host(entry).map_err(|why| {
                format!("`tools.http_get.allow` entry `{entry}` {why}; give a host name, an IP address, either with `:port`, or `*.domain`")
            })?);
        }
        let timeout_s = self.timeout_s.unwrap_or(HTTP_GET_TIMEOUT_S);
        if !(timeout_s > 0.0 && timeout_s <= HTTP_GET_MAX_TIMEOUT_S) {
            return Err(format!(
                "`tools.http_get.timeout_s` is {timeout_s}; give more than 0 and at most {HTTP_GET_MAX_TIMEOUT_S} seconds"
            ));
        }
        let max_bytes = self.max_bytes.unwrap_or(HTTP_GET_MAX_BYTES);
        if max_bytes == 0 || max_bytes > HTTP_GET_MAX_MAX_BYTES {
            return Err(format!(
                "`tools.http_get.max_bytes` is {max_bytes}; give 1 to {HTTP_GET_MAX_MAX_BYTES}"
            ));
        }
        Ok(HttpGet {
            allow,
            timeout_s,
            max_bytes,
        })
    }
}

/// An allow-list entry's host (an IPv6 address without its brackets, a trailing dot
/// dropped) and the text of its port, if it names one; or why it has no such parts.
fn parts(entry: &str) -> Result<(&str, Option<&str>), &'static str> {
    let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, "")) => (ip, None),
            Some((ip, p)) => (ip, Some(p.strip_prefix(':').ok_or("has a bad port")?)),
            None => return Err("has an unclosed `[`"),
        }
    } else if entry.matches(':').count() > 1 {
        // An IPv6 address without brackets (no port).
        (entry, None)
    } else {
        match entry.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (entry, None),
        }
    };
    Ok((host.trim_end_matches('.'), port))
}

/// A checked allow-list entry's host and port (`None`: any port); `None` for an entry
/// that does not parse (a plan's, unchecked), which allows nothing.
fn split_entry(entry: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = parts(entry).ok()?;
    match port {
        Some(p) => Some((host, Some(p.parse().ok()?))),
        None => Some((host, None)),
    }
}

/// An allow-list entry, lowercased, or why it is not one.
fn check_host(entry: &str) -> Result<String, &'static str> {
    let e = entry.trim().trim_end_matches('.').to_ascii_lowercase();
    if e.is_empty() {
        return Err("is empty");
    }
    if e.contains("://") || e.contains('/') || e.contains('@') || e.contains('?') {
        return Err("is not a host (no scheme, path, user or query)");
    }
    let (host, port) = parts(&e)?;
    if let Some(p) = port {
        if p.parse::<u16>().map_or(true, |p| p == 0) {
            return Err("has a bad port");
        }
    }
    let wildcard = host.strip_prefix("*.");
    let name = wildcard.unwrap_or(host);
    if wildcard.is_some() && port.is_some() {
        return Err("names a port with a wildcard");
    }
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        if wildcard.is_some() {
            return Err("is a wildcard over an IP address (a wildcard matches names only)");
        }
        if ip.is_unspecified() {
            return Err("is the unspecified address, which reaches every local port");
        }
        return Ok(e);
    }
    if let Some(domain) = wildcard {
        if !domain.contains('.') {
            return Err("is a wildcard over a single label (give `*.example.com`, not `*.com`)");
        }
        if domain
            .rsplit('.')
            .next()
            .is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()))
        {
            return Err("is a wildcard over numbers, which would match IP addresses");
        }
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        return Err("is not a host name");
    }
    Ok(e)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn get(allow: &[&str]) -> HttpGet {
        HttpGetSection {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
        .build()
        .unwrap()
    }

    #[test]
    fn the_allow_list_matches_hosts_ports_and_subdomains_only() {
        let g = get(&["docs.rs", "127.0.0.1:8080", "*.python.org", "[::1]:9"]);
        assert!(g.allows("docs.rs", 443));
        assert!(g.allows("docs.rs", 80));
        assert!(!g.allows("evil-docs.rs", 443));
        assert!(!g.allows("docs.rs.evil.com", 443));
        assert!(g.allows("127.0.0.1", 8080));
        assert!(!g.allows("127.0.0.1", 8081));
        assert!(g.allows("peps.python.org", 443));
        assert!(!g.allows("python.org", 443));
        assert!(!g.allows("xpython.org", 443));
        assert!(g.allows("::1", 9));
        assert!(!g.allows("::1", 10));
        // An address without a port allows every port; a trailing dot is the same name.
        let g = get(&["[::1]", "10.0.0.7", "localhost.", "*.example.com."]);
        assert!(g.allows("::1", 80) && g.allows("::1", 8443));
        assert!(g.allows("10.0.0.7", 1));
        assert!(g.allows("localhost", 80) && g.allows("localhost.", 80));
        assert!(g.allows("a.example.com", 443));
        // A wildcard never matches an address.
        let g = get(&["*.example.com"]);
        assert!(g.allows("1.example.com", 443));
        let unchecked = HttpGet {
            allow: vec!["*.0.1".into()],
            timeout_s: 1.0,
            max_bytes: 1,
        };
        assert!(!unchecked.allows("127.0.0.1", 443));
        assert!(unchecked.check().is_err());
    }

    #[test]
    fn bad_sections_say_what_is_valid() {
        for (allow, want) in [
            (vec![], "is empty"),
            (vec!["https://docs.rs"], "not a host"),
            (vec!["docs.rs/x"], "not a host"),
            (vec!["user@docs.rs"], "not a host"),
            (vec!["docs.rs:0"], "bad port"),
            (vec!["docs.rs:99999"], "bad port"),
            (vec!["*.x.org:80"], "wildcard"),
            (vec!["bad_host!"], "not a host name"),
            (vec!["*.1"], "wildcard over a single label"),
            (vec!["*.0.1"], "wildcard over numbers"),
            (vec!["*.0.0.1"], "wildcard over numbers"),
            (vec!["*.com"], "single label"),
            (vec!["0.0.0.0"], "unspecified"),
            (vec!["[::]:80"], "unspecified"),
        ] {
            let err = HttpGetSection {
                allow: allow.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }
            .build()
            .unwrap_err();
            assert!(err.contains(want), "{allow:?}: {err}");
        }
        let err = HttpGetSection {
            allow: vec!["docs.rs".into()],
            timeout_s: Some(0.0),
            ..Default::default()
        }
        .build()
        .unwrap_err();
        assert!(err.contains("timeout_s"), "{err}");
    }

    #[test]
    fn every_tool_is_declared_once_and_offered_by_its_setting() {
        let mut names = names();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "a tool declared twice");
        let none = ToolSettings::default();
        let offered: Vec<_> = none.offered().map(|t| t.name).collect();
        assert_eq!(offered, standard_names());
        let with = ToolSettings {
            http_get: Some(get(&["docs.rs"])),
            forking: true,
            ..Default::default()
        };
        let offered: Vec<_> = with.offered().map(|t| t.name).collect();
        assert!(offered.contains(&"http_get") && offered.contains(&"fork_run"));
        assert!(!offered.contains(&"run_command"));
    }
}

//! Who calls the HTTP API: a bearer token from the config (`[http.tokens."NAME"]`, kept as
//! its SHA-256), with its scopes and, optionally, the accounts it is limited to. A token
//! limited to accounts calls as the scoped client identity NAME (the coordinator then shows
//! and charges only those accounts' forks, ADR 17); one that is not calls as an operator,
//! within its scopes. With no token configured, the API answers loopback peers only.

use super::problem::Problem;
use axum::http::HeaderMap;
use forkfleet_shared::api::{Access, Caller};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

/// One HTTP API token as configured: the SHA-256 of the token (the token itself is never
/// stored), what it may do, and the accounts it is limited to (every account when `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpToken {
    pub sha256: [u8; 32],
    pub scopes: std::collections::BTreeSet<forkfleet_shared::api::Access>,
    pub accounts: Option<std::collections::BTreeSet<String>>,
}

/// Who a request is from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub scopes: BTreeSet<Access>,
    pub accounts: Option<BTreeSet<String>>,
}

impl Principal {
    /// May it do what `need` asks? `admin` includes `write`, which includes `read`.
    pub fn may(&self, need: Access) -> bool {
        self.scopes.iter().any(|s| *s >= need)
    }

    pub fn scopes_text(&self) -> String {
        self.scopes
            .iter()
            .map(|s| format!("`{}`", s.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The caller the coordinator answers for.
    pub fn caller(&self) -> Caller {
        match &self.accounts {
            Some(_) => Caller::Client(self.name.clone()),
            None => Caller::Admin,
        }
    }
}

/// The configured tokens, by name, and the stream tickets issued for them.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    tokens: BTreeMap<String, HttpToken>,
    /// Tickets by their SHA-256: who they stand for, until when.
    tickets: std::sync::Arc<std::sync::Mutex<Tickets>>,
}

/// Issued stream tickets by their SHA-256: who each stands for, until when.
type Tickets = BTreeMap<[u8; 32], (Principal, std::time::Instant)>;

/// How long a stream ticket admits `GET .../stream` (an `EventSource` reconnecting later
/// gets a new one).
pub const TICKET_TTL: std::time::Duration = std::time::Duration::from_secs(60);

/// The SHA-256 of a token, as configured.
pub fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Tokens {
    pub fn new(tokens: BTreeMap<String, HttpToken>) -> Self {
        Self {
            tokens,
            tickets: Default::default(),
        }
    }

    /// A new stream ticket standing for `principal` for [`TICKET_TTL`]: what an
    /// `EventSource`, which cannot send headers, puts in its URL instead of a token.
    pub fn issue_ticket(&self, principal: &Principal) -> std::io::Result<String> {
        let ticket = new_token()?.replacen("ff_", "fft_", 1);
        let now = std::time::Instant::now();
        let mut tickets = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        tickets.retain(|_, (_, until)| *until > now);
        tickets.insert(hash(&ticket), (principal.clone(), now + TICKET_TTL));
        Ok(ticket)
    }

    fn ticket(&self, given: &str) -> Result<Principal, Problem> {
        let tickets = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        match tickets.get(&hash(given)) {
            Some((p, until)) if *until > std::time::Instant::now() => Ok(p.clone()),
            Some(_) => Err(Problem::unauthorized(
                "the stream ticket expired: get another with `POST /api/v1/stream-tickets`",
            )),
            None => Err(Problem::unauthorized(
                "the stream ticket is not one this server issued",
            )),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The accounts each account-limited token's identity may use, for the coordinator's
    /// grants.
    pub fn grants(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.tokens
            .iter()
            .filter_map(|(n, t)| t.accounts.clone().map(|a| (n.clone(), a)))
            .collect()
    }

    /// The caller of a request: its bearer token (the `Authorization` header), or a stream
    /// ticket (`?ticket=`, which an `EventSource` can send), or, with no token configured,
    /// any loopback peer as the operator.
    pub fn authenticate(
        &self,
        headers: &HeaderMap,
        query: Option<&str>,
        peer: SocketAddr,
    ) -> Result<Principal, Problem> {
        if self.tokens.is_empty() {
            if !peer.ip().is_loopback() {
                return Err(Problem::forbidden(
                    "no token is configured, so the API answers this machine only: configure [http.tokens] (docs/HTTP.md)",
                ));
            }
            return Ok(Principal {
                name: "local".to_string(),
                scopes: [Access::Admin].into(),
                accounts: None,
            });
        }
        let given = match bearer(headers) {
            Some(token) => token,
            None => match query_ticket(query) {
                // Only `GET .../stream` gets this far with one (`guard`).
                Some(ticket) => return self.ticket(&ticket),
                None => {
                    return Err(Problem::unauthorized(
                        "no token: send `Authorization: Bearer TOKEN`",
                    ))
                }
            },
        };
        let h = hash(&given);
        self.tokens
            .iter()
            .find(|(_, t)| t.sha256 == h)
            .map(|(name, t)| Principal {
                name: name.clone(),
                scopes: t.scopes.clone(),
                accounts: t.accounts.clone(),
            })
            .ok_or_else(|| Problem::unauthorized("the token is not one this server knows"))
    }
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    let v = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_string())
}

fn query_ticket(query: Option<&str>) -> Option<String> {
    super::form_pairs(query)
        .into_iter()
        .find(|(k, _)| k == "ticket")
        .map(|(_, v)| v)
}

/// A new random token: 32 bytes from the operating system's generator, hex, `ff_` first.
pub fn new_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(format!("ff_{}", hex::encode(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> Tokens {
        let mut m = BTreeMap::new();
        m.insert(
            "reader".to_string(),
            HttpToken {
                sha256: hash("r-token"),
                scopes: [Access::Read].into(),
                accounts: None,
            },
        );
        m.insert(
            "team".to_string(),
            HttpToken {
                sha256: hash("t-token"),
                scopes: [Access::Write].into(),
                accounts: Some(["team-a".to_string()].into()),
            },
        );
        Tokens::new(m)
    }

    fn with(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", format!("Bearer {token}").parse().unwrap());
        h
    }

    #[test]
    fn tokens_name_the_caller_and_its_scopes() {
        let peer: SocketAddr = "10.0.0.2:1".parse().unwrap();
        let t = tokens();
        let r = t.authenticate(&with("r-token"), None, peer).unwrap();
        assert!(r.may(Access::Read) && !r.may(Access::Write));
        assert_eq!(r.caller(), Caller::Admin);
        // A token is never taken from a URL; a ticket issued for it is, and stands for it.
        assert_eq!(
            t.authenticate(&HeaderMap::new(), Some("access_token=t-token"), peer)
                .unwrap_err()
                .status,
            401
        );
        let team = t.authenticate(&with("t-token"), None, peer).unwrap();
        let ticket = t.issue_ticket(&team).unwrap();
        let w = t
            .authenticate(&HeaderMap::new(), Some(&format!("ticket={ticket}")), peer)
            .unwrap();
        assert!(w.may(Access::Read) && w.may(Access::Write) && !w.may(Access::Admin));
        assert_eq!(w.caller(), Caller::Client("team".into()));
        assert_eq!(
            t.authenticate(&HeaderMap::new(), Some("ticket=fft_made_up"), peer)
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(
            t.authenticate(&with("nope"), None, peer)
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(
            t.authenticate(&HeaderMap::new(), None, peer)
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(t.grants().len(), 1);
    }

    #[test]
    fn without_tokens_only_loopback_is_answered() {
        let none = Tokens::default();
        let local = none
            .authenticate(&HeaderMap::new(), None, "127.0.0.1:5".parse().unwrap())
            .unwrap();
        assert!(local.may(Access::Admin));
        let far = none.authenticate(&HeaderMap::new(), None, "10.1.1.1:5".parse().unwrap());
        assert_eq!(far.unwrap_err().status, 403);
    }
}

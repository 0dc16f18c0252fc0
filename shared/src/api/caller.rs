//! Who sent a request: the coordinator answers every operation for a [`Caller`], taken
//! from the subject the request arrived on, never from a field the caller fills in
//! (ADR 17).
//!
//! | subject | caller |
//! |---|---|
//! | `ff.api.coordinator` ([`super::API_SUBJECT`]) | [`Caller::Admin`] (operators, and every client of an unrestricted set-up) |
//! | `ff.api.worker` ([`WORKER_API_SUBJECT`]) | [`Caller::Worker`] (the agents' fork tools) |
//! | `ff.api.client.<identity>` ([`client_api_subject`]) | [`Caller::Client`] |
//!
//! On a nats-server with the permissions of `forkfleet cluster auth`, only an operator may
//! publish on the first subject, only workers on the second, and a client only on its own
//! `ff.api.client.<identity>`. An in-process client (the embedded mode) is an admin.

use crate::subjects::{self, SubjectError};
use serde::{Deserialize, Serialize};

/// The service subject of the agents' fork tools (on NATS: `ff.api.worker`).
pub const WORKER_API_SUBJECT: &str = "worker";
/// The service subjects of scoped clients, as served: `client.*` (on NATS:
/// `ff.api.client.*`).
pub const CLIENT_API_PATTERN: &str = "client.*";
const CLIENT_API_PREFIX: &str = "client.";

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "role", content = "identity")]
pub enum Caller {
    /// An operator: no scoping.
    Admin,
    /// A worker (an agent's fork tools): trusted like the coordinator's own workers are.
    Worker,
    /// A scoped client: it acts on the forks of the accounts its identity may use.
    Client(String),
}

impl Caller {
    /// The caller of a request that arrived on service subject `subject` (without the
    /// `ff.api.` prefix). Any subject other than the worker's and the clients' is an
    /// admin's (the API subject, or another one a test serves).
    pub fn of_subject(subject: &str) -> Caller {
        if subject == WORKER_API_SUBJECT {
            return Caller::Worker;
        }
        match subject.strip_prefix(CLIENT_API_PREFIX) {
            Some(identity) => Caller::Client(identity.to_string()),
            None => Caller::Admin,
        }
    }

    /// Who the caller is, in a record of what it did (an answer's `by`): `admin`,
    /// `worker`, or a client's identity.
    pub fn name(&self) -> &str {
        match self {
            Caller::Admin => "admin",
            Caller::Worker => "worker",
            Caller::Client(id) => id,
        }
    }

    /// The identity of a scoped client.
    pub fn identity(&self) -> Option<&str> {
        match self {
            Caller::Client(id) => Some(id),
            _ => None,
        }
    }
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Caller::Admin => f.write_str("admin"),
            Caller::Worker => f.write_str("worker"),
            Caller::Client(id) => write!(f, "client `{id}`"),
        }
    }
}

/// Check a client identity: 1 to 64 letters, digits, `_` or `-` (one subject token).
pub fn check_identity(identity: &str) -> Result<(), SubjectError> {
    subjects::check_identity(identity)
}

/// The service subject of client `identity`: `client.<identity>` (on NATS:
/// `ff.api.client.<identity>`).
pub fn client_api_subject(identity: &str) -> Result<String, SubjectError> {
    check_identity(identity)?;
    Ok(format!("{CLIENT_API_PREFIX}{identity}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_come_from_subjects() {
        assert_eq!(Caller::of_subject("coordinator"), Caller::Admin);
        assert_eq!(Caller::of_subject("worker"), Caller::Worker);
        assert_eq!(
            Caller::of_subject("client.alice"),
            Caller::Client("alice".into())
        );
        assert_eq!(Caller::of_subject("test-subject"), Caller::Admin);
        assert_eq!(client_api_subject("bob").unwrap(), "client.bob");
        assert_eq!(
            subjects::api_subject(&client_api_subject("bob").unwrap()).unwrap(),
            "ff.api.client.bob"
        );
    }

    #[test]
    fn identities_are_one_token() {
        for bad in ["", "a.b", "a*", ">", "a b", &"x".repeat(65)] {
            let err = client_api_subject(bad).unwrap_err();
            assert!(err.to_string().contains("client identity"), "{err}");
        }
        assert!(check_identity("team_a-1").is_ok());
    }
}

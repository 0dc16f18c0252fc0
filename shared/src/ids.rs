//! Identifiers: newtypes over UUID v7, so keys sort by creation time.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use uuid::Uuid;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new id; v7, so ids made later sort after ids made earlier.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }
            /// The 16 bytes, big-endian: the store's key prefix.
            pub fn as_bytes(&self) -> &[u8; 16] {
                self.0.as_bytes()
            }
            pub fn from_bytes(bytes: [u8; 16]) -> Self {
                Self(Uuid::from_bytes(bytes))
            }
            /// What kind of id this is, for error messages.
            pub const KIND: &'static str = $prefix;
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", $prefix, self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s.trim())
                    .map(Self)
                    .map_err(|_| IdError { kind: $prefix, input: s.to_string() })
            }
        }
    };
}

id_type!(
    /// One agent conversation: a root run or a branch run.
    RunId,
    "run"
);
id_type!(
    /// One fork: a parent run split into branches.
    ForkId,
    "fork"
);
id_type!(
    /// One worker process.
    WorkerId,
    "worker"
);
id_type!(
    /// One checkpoint of a run.
    CheckpointId,
    "checkpoint"
);
id_type!(
    /// One budget reservation: money held for a model call until its usage is settled.
    ReservationId,
    "reservation"
);

/// A string that is not a valid id of the kind asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a valid {kind} id (expected a UUID such as 0192d2f4-5b7e-7c3a-9f1e-2b4c6d8e0a1b)")]
pub struct IdError {
    pub kind: &'static str,
    pub input: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sort_by_creation() {
        let a = RunId::new();
        let b = RunId::new();
        assert!(a < b);
        assert!(a.as_bytes() < b.as_bytes());
    }

    #[test]
    fn parse_round_trip_and_error() {
        let a = ForkId::new();
        assert_eq!(a.to_string().parse::<ForkId>(), Ok(a));
        let err = "nope".parse::<ForkId>().unwrap_err();
        assert!(err.to_string().contains("not a valid fork id"));
    }
}

//! Size bounds of a request's user-given strings, checked before any work is done: a
//! request beyond what its operation can legitimately carry is a `bad_input` error that
//! says which field was too long and by how much, never quoting it (so a megabyte-long
//! prefix comes back neither in the error nor in a stored reply). [`truncated`] shortens
//! user input that an error message quotes.

use super::{ApiError, ApiErrorKind, ApiRequest};
use crate::spec::MAX_LABEL_LEN;

/// A fork or run id as text (a UUID: 36 characters): the longest useful prefix.
pub const MAX_ID_PREFIX_LEN: usize = 36;
/// A checkpoint as named by a request: its label, number or id prefix.
pub const MAX_CHECKPOINT_REF_LEN: usize = 256;
/// A user message (`steer`, `continue`, a denial's reason).
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// Hashes one `missing_blobs` request may ask about.
pub const MAX_BLOBS_PER_CALL: usize = 8192;
/// The part of a blob a client uploads or reads at once (`put_blob_part`,
/// `get_blob_part`): a request or reply carrying it stays within
/// [`super::MAX_INLINE_BYTES`] with its envelope, so it is never itself moved through the
/// blob store. (The coordinator takes larger parts: `PUT /blobs/{blob}` is one.)
pub const MAX_BLOB_PART_BYTES: usize = super::MAX_INLINE_BYTES - 4096;
/// The words of the coordinator's answer when an upload in parts must begin again at
/// offset 0 (its parts were lost); the client that reads them starts over.
pub const UPLOAD_RESTART: &str = "start again at offset 0";
/// How much of a user's input an error message quotes.
pub const QUOTE_MAX_CHARS: usize = 80;

/// `s` as an error message quotes it: at most [`QUOTE_MAX_CHARS`] characters, then
/// `…(N bytes)` when it was longer.
pub fn truncated(s: &str) -> String {
    truncated_to(s, QUOTE_MAX_CHARS)
}

/// `s` cut after `max` characters, then `…(N bytes)` when it was longer.
pub fn truncated_to(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_string(),
        Some((end, _)) => format!("{}…({} bytes)", &s[..end], s.len()),
    }
}

/// `Ok` when every bounded string of `req` is within its bound.
pub fn check_request_size(req: &ApiRequest) -> Result<(), ApiError> {
    use ApiRequest as R;
    let label = MAX_LABEL_LEN;
    let fields: Vec<(&str, &str, usize)> = match req {
        R::FindFork(op) => vec![("prefix", &op.prefix, MAX_ID_PREFIX_LEN)],
        R::FindRun(op) => vec![("prefix", &op.prefix, MAX_ID_PREFIX_LEN)],
        R::AgentMerge(op) => vec![("pick", &op.pick, label)],
        R::Merge(op) => vec![("pick", &op.pick, label)],
        R::Terminate(op) => vec![("label", &op.label, label)],
        R::Steer(op) => vec![
            ("label", &op.label, label),
            ("text", &op.text, MAX_MESSAGE_BYTES),
        ],
        R::Continue(op) => vec![
            ("label", &op.label, label),
            ("text", &op.text, MAX_MESSAGE_BYTES),
        ],
        R::Decide(op) => [("label", op.label.as_str(), label)]
            .into_iter()
            .chain(
                op.call_id
                    .as_deref()
                    .map(|c| ("call_id", c, MAX_CHECKPOINT_REF_LEN)),
            )
            .chain(
                op.reason
                    .as_deref()
                    .map(|r| ("reason", r, MAX_MESSAGE_BYTES)),
            )
            .collect(),
        R::Topup(op) => op
            .branch
            .as_deref()
            .map(|b| vec![("branch", b, label)])
            .unwrap_or_default(),
        R::MoveBudget(op) => vec![("from", &op.from, label), ("to", &op.to, label)],
        R::AccountSet(op) => vec![("name", &op.name, label)],
        R::CheckpointSave(op) => vec![("label", &op.label, MAX_CHECKPOINT_REF_LEN)],
        R::CheckpointRemove(op) => vec![("checkpoint", &op.checkpoint, MAX_CHECKPOINT_REF_LEN)],
        R::Rewind(op) => vec![("checkpoint", &op.checkpoint, MAX_CHECKPOINT_REF_LEN)],
        R::ForkCheckpoint(op) => vec![("checkpoint", &op.checkpoint, MAX_CHECKPOINT_REF_LEN)],
        R::RunFork(op) => op
            .options
            .label
            .as_deref()
            .map(|l| ("label", l, label))
            .into_iter()
            .chain(
                op.options
                    .set
                    .iter()
                    .map(|s| ("set", s.as_str(), MAX_MESSAGE_BYTES)),
            )
            .collect(),
        R::RunResume(op) => op
            .text
            .as_deref()
            .map(|t| vec![("text", t, MAX_MESSAGE_BYTES)])
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let counted: Option<(&str, usize, usize)> = match req {
        R::MissingBlobs(op) => Some(("blobs", op.blobs.len(), MAX_BLOBS_PER_CALL)),
        _ => None,
    };
    if let Some((field, n, max)) = counted.filter(|(_, n, max)| n > max) {
        return Err(ApiError::new(
            ApiErrorKind::BadInput,
            format!(
                "`{}` request: `{field}` holds {n}, more than the {max} one request may carry; split it",
                req.op()
            ),
        ));
    }
    for (field, value, max) in fields {
        if value.len() > max {
            return Err(ApiError::new(
                ApiErrorKind::BadInput,
                format!(
                    "`{}` request: `{field}` is {} bytes long, more than the {max} it can be",
                    req.op(),
                    value.len()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::api::{FindFork, Steer};
    use crate::ids::ForkId;

    #[test]
    fn an_oversized_prefix_is_refused_without_being_echoed() {
        let huge = "a".repeat(6 * 1024 * 1024);
        let err = check_request_size(&FindFork { prefix: huge }.into()).unwrap_err();
        assert_eq!(err.kind, ApiErrorKind::BadInput);
        assert!(err.message.len() < 200, "{}", err.message);
        assert!(err.message.contains("prefix"), "{}", err.message);
        assert!(!err.message.contains("aaaa"), "{}", err.message);
        let ok = FindFork {
            prefix: "0193".into(),
        };
        check_request_size(&ok.into()).unwrap();
        let steer = Steer {
            fork: ForkId::new(),
            label: "x".repeat(65),
            text: "hi".into(),
        };
        assert!(check_request_size(&steer.into()).is_err());
    }

    #[test]
    fn quotes_are_truncated() {
        assert_eq!(truncated("short"), "short");
        let long = "é".repeat(1000);
        let t = truncated(&long);
        assert!(t.starts_with(&"é".repeat(80)), "{t}");
        assert!(t.ends_with("…(2000 bytes)"), "{t}");
    }
}

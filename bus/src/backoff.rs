//! The bus's one backoff: a connection, a pull, a consumer creation, a forward or an API
//! call that failed is tried again after a pause that doubles from [`RETRY_MIN`] to
//! [`RETRY_MAX`].

use std::time::Duration;

/// The first pause.
pub(crate) const RETRY_MIN: Duration = Duration::from_millis(50);
/// The longest pause.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(2);

/// Exponential backoff between [`RETRY_MIN`] and [`RETRY_MAX`].
pub(crate) struct Backoff(Duration);

impl Backoff {
    pub(crate) fn new() -> Self {
        Self(RETRY_MIN)
    }

    /// The next pause (each twice the one before, at most [`RETRY_MAX`]).
    pub(crate) fn next(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(RETRY_MAX);
        d
    }

    /// Back to the first pause (after a success).
    pub(crate) fn reset(&mut self) {
        self.0 = RETRY_MIN;
    }
}

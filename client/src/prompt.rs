//! Reading the person at the terminal: one line at a time, off the async runtime.

/// One line from stdin, trimmed (`None` at its end), read on a blocking thread.
pub async fn read_line() -> std::io::Result<Option<String>> {
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        match std::io::stdin().read_line(&mut line)? {
            0 => Ok(None),
            _ => Ok(Some(line.trim().to_string())),
        }
    })
    .await
    .map_err(std::io::Error::other)?
}

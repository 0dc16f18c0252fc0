//! `http_get`: fetch a URL on a host the spec allows (`[tools.http_get] allow = [...]`),
//! and read its body as text. Off unless the spec enables it.
//!
//! The worker makes the request itself (not a confined command), directly (no proxy from
//! the environment): the allow-list is the guard. Only `http` and `https`, no user or
//! password in the URL, redirects followed (at most [`MAX_REDIRECTS`]) only to allowed
//! hosts, no cookies kept and no `Referer` sent; the body is read up to the spec's
//! `max_bytes` within its `timeout_s`, a binary body is not shown, and control characters
//! (a remote server's terminal escapes) are replaced. A status other than 2xx is a failed
//! result that still shows the body.

use super::{tool, Env, Tool, ToolOutcome};
use crate::error::WorkerError;
use crate::toolspec::ToolSpec;
use forkfleet_shared::tools::HttpGet;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

pub(super) const TOOL: Tool = tool!("http_get", spec, |a, env| run(a, env));

/// Redirects followed, at most.
pub const MAX_REDIRECTS: usize = 5;

fn spec() -> ToolSpec {
    ToolSpec {
        name: "http_get".to_string(),
        description: "Fetch a web page or document by HTTP GET and read its body as text (cut \
            at the run's limit). Only the hosts this run allows can be fetched; the answer \
            says which when a host is not allowed."
            .to_string(),
        parameters: json!({"type": "object", "properties": {
            "url": {"type": "string", "description": "An http:// or https:// URL on an allowed host."}
        }, "required": ["url"]}),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GetArgs {
    url: String,
}

async fn run(a: GetArgs, env: Env<'_>) -> Result<ToolOutcome, WorkerError> {
    Ok(match &env.settings.http_get {
        Some(settings) => get(&a.url, settings).await,
        None => ToolOutcome::err(
            "`http_get` is not enabled for this run (the fork spec has no [tools.http_get] table)",
        ),
    })
}

/// The allowed hosts, for the model.
fn allowed(settings: &HttpGet) -> String {
    settings.allow.join(", ")
}

/// Why `url` may not be fetched, if it may not.
fn refusal(url: &reqwest::Url, settings: &HttpGet) -> Option<String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Some(format!(
            "`{}` URLs cannot be fetched; give an http:// or https:// URL",
            url.scheme()
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Some("a URL with a user or password cannot be fetched".to_string());
    }
    let Some(host) = url.host_str() else {
        return Some("the URL has no host".to_string());
    };
    let host = host.trim_matches(['[', ']']).to_ascii_lowercase();
    let port = url.port_or_known_default().unwrap_or(0);
    (!settings.allows(&host, port)).then(|| {
        format!(
            "host `{host}` (port {port}) is not allowed for this run; allowed: {}",
            allowed(settings)
        )
    })
}

async fn get(url: &str, settings: &HttpGet) -> ToolOutcome {
    let parsed = match reqwest::Url::parse(url.trim()) {
        Ok(u) => u,
        Err(e) => return ToolOutcome::err(format!("`{url}` is not a URL: {e}")),
    };
    if let Some(why) = refusal(&parsed, settings) {
        return ToolOutcome::err(why);
    }
    let policy_settings = Arc::new(settings.clone());
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() > MAX_REDIRECTS {
            attempt.error(format!("more than {MAX_REDIRECTS} redirects"))
        } else if let Some(why) = refusal(attempt.url(), &policy_settings) {
            let to = shown(attempt.url());
            attempt.error(format!("redirected to {to}: {why}"))
        } else {
            attempt.follow()
        }
    });
    let timeout =
        Duration::try_from_secs_f64(settings.timeout_s).unwrap_or(Duration::from_secs(20));
    let client = match reqwest::Client::builder()
        .redirect(policy)
        .referer(false)
        .no_proxy()
        .timeout(timeout)
        .user_agent(concat!("forkfleet-http-get/", env!("CARGO_PKG_VERSION")))
        .build()
    {
        Ok(c) => c,
        Err(e) => return ToolOutcome::err(format!("cannot make the request: {e}")),
    };
    let mut response = match client.get(parsed.clone()).send().await {
        Ok(r) => r,
        Err(e) => {
            return ToolOutcome::err(format!(
                "GET {} failed: {}",
                shown(&parsed),
                error_chain(&e)
            ))
        }
    };
    let status = response.status();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let max = settings.max_bytes as usize;
    let mut body = Vec::new();
    let mut cut = false;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = max - body.len();
                if chunk.len() > room {
                    body.extend_from_slice(&chunk[..room]);
                    cut = true;
                    break;
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => {
                return ToolOutcome::err(format!(
                    "GET {} ({status}): the body broke off after {} bytes: {}",
                    shown(response.url()),
                    body.len(),
                    error_chain(&e)
                ))
            }
        }
    }
    let mut out = format!(
        "GET {}: {status}\ncontent-type: {}\n",
        shown(response.url()),
        clean(&content_type)
    );
    if is_binary(&content_type, &body) {
        out.push_str(&format!(
            "\n[a binary body ({} bytes{}) is not shown]",
            body.len(),
            if cut { " read, more not" } else { "" }
        ));
    } else {
        if cut {
            // Said before the body: a long answer is cut at its end.
            out.push_str(&format!(
                "[the body is cut at {max} bytes, the run's max_bytes]\n"
            ));
            // Not in the middle of a character.
            if let Err(e) = std::str::from_utf8(&body) {
                if e.error_len().is_none() {
                    body.truncate(e.valid_up_to());
                }
            }
        }
        out.push('\n');
        out.push_str(&clean(&String::from_utf8_lossy(&body)));
    }
    if status.is_success() {
        ToolOutcome::ok(out)
    } else {
        ToolOutcome::err(out)
    }
}

/// The longest URL an answer shows.
const SHOWN_URL_CHARS: usize = 300;

/// `url` as an answer shows it: without a user or password, and cut when long.
fn shown(url: &reqwest::Url) -> String {
    let mut url = url.clone();
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let text = url.to_string();
    match text.char_indices().nth(SHOWN_URL_CHARS) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text,
    }
}

/// `text` with its control characters (but newlines and tabs) replaced: what a remote
/// server sends must not reach a terminal as escapes.
fn clean(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                '\u{fffd}'
            } else {
                c
            }
        })
        .collect()
}

/// A body to keep from the model: bytes that are not text. A NUL in its first 8 KiB is
/// binary whatever the type says; a text type (`text/*`, JSON, XML, ...) is shown (bytes
/// that are not UTF-8 replaced); any other type (servers send `application/octet-stream`
/// for a file they cannot name, a README or a Makefile) is shown when it is UTF-8.
fn is_binary(content_type: &str, body: &[u8]) -> bool {
    if body.iter().take(8192).any(|&b| b == 0) {
        return true;
    }
    let ct = content_type.to_ascii_lowercase();
    let texty = ct.starts_with("text/")
        || [
            "json",
            "xml",
            "javascript",
            "yaml",
            "toml",
            "csv",
            "x-www-form-urlencoded",
        ]
        .iter()
        .any(|t| ct.contains(t));
    // A body cut at max_bytes may end inside a character: that is still text.
    !texty && std::str::from_utf8(body).is_err_and(|e| e.error_len().is_some())
}

/// An error with its causes (reqwest's own message alone says little).
fn error_chain(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

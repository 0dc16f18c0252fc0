//! The OpenAPI 3.1 document of the HTTP API, generated from the same declarations the
//! routes are (`forkfleet_shared::api::ROUTES`, plus the routes of `stream`): each
//! operation's path, method, summary and description (its doc comment), its path, query
//! and body fields with their JSON types, the scope it needs (`x-forkfleet-access`), and
//! its answer. A field or answer whose type is one of forkfleet's own structures is
//! described by name (`x-rust-type`, documented in docs/API.md) rather than restated.

use super::PREFIX;
use axum::response::IntoResponse;
use forkfleet_shared::api::{Route, ROUTES};
use serde_json::{json, Map, Value};

/// `GET /api/v1/openapi.json`.
pub async fn serve() -> impl IntoResponse {
    axum::Json(document())
}

/// The JSON schema of a field of Rust type `ty` (as the declaration spells it), and
/// whether the field may be left out.
fn schema_of(ty: &str) -> (Value, bool) {
    let ty: String = ty.chars().filter(|c| !c.is_whitespace()).collect();
    if let Some(inner) = ty.strip_prefix("Option<").and_then(|s| s.strip_suffix('>')) {
        return (schema_of(inner).0, true);
    }
    if let Some(inner) = ty.strip_prefix("Vec<").and_then(|s| s.strip_suffix('>')) {
        return (
            json!({ "type": "array", "items": schema_of(inner).0 }),
            false,
        );
    }
    let schema = match ty.as_str() {
        "String" => json!({ "type": "string" }),
        "bool" => json!({ "type": "boolean" }),
        "u64" | "u32" | "usize" => json!({ "type": "integer", "minimum": 0 }),
        "i64" => json!({ "type": "integer" }),
        "f64" => json!({ "type": "number" }),
        "ForkId" | "RunId" | "CheckpointId" => json!({ "type": "string", "format": "uuid" }),
        "BlobHash" => json!({ "type": "string", "pattern": "^[0-9a-f]{64}$" }),
        other => json!({ "x-rust-type": other }),
    };
    (schema, false)
}

fn summary(doc: &str) -> String {
    let first = doc.split("\n\n").next().unwrap_or_default();
    let line = first.split(". ").next().unwrap_or(first);
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn description(doc: &str) -> String {
    doc.lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_string()
}

fn problem_responses() -> Value {
    json!({
        "default": {
            "description": "What was wrong (RFC 9457)",
            "content": { "application/problem+json": { "schema": { "$ref": "#/components/schemas/Problem" } } }
        }
    })
}

fn operation(route: &Route) -> Value {
    let path_fields: Vec<&str> = route.path_fields().collect();
    let mut parameters = Vec::new();
    let mut body_props = Map::new();
    let mut body_required = Vec::new();
    for (name, ty) in route.fields {
        let (schema, optional) = schema_of(ty);
        if path_fields.contains(name) {
            parameters
                .push(json!({ "name": name, "in": "path", "required": true, "schema": schema }));
        } else if route.method == "GET" {
            parameters.push(
                json!({ "name": name, "in": "query", "required": !optional, "schema": schema }),
            );
        } else {
            if !optional && *ty != "bool" {
                body_required.push(json!(name));
            }
            body_props.insert(name.to_string(), schema);
        }
    }
    let list = route.reply.replace(' ', "").starts_with("Vec<");
    if list {
        parameters.push(json!({ "name": "limit", "in": "query", "required": false, "schema": { "type": "integer", "minimum": 0 } }));
        parameters.push(json!({ "name": "offset", "in": "query", "required": false, "schema": { "type": "integer", "minimum": 0 } }));
    }
    if !route.idempotent {
        parameters.push(json!({
            "name": "Idempotency-Key", "in": "header", "required": false,
            "description": "The same key with the same request again returns the first answer",
            "schema": { "type": "string" }
        }));
    }
    let ok = if route.name == "get_blob" {
        json!({ "description": "The blob's bytes", "content": { "application/octet-stream": { "schema": { "type": "string", "contentMediaType": "application/octet-stream" } } } })
    } else {
        let mut r = json!({
            "description": format!("The answer: {}", route.reply),
            "content": { "application/json": { "schema": schema_of(route.reply).0 } }
        });
        if list {
            r["headers"] = json!({ "X-Total-Count": { "description": "Items before paging", "schema": { "type": "integer" } } });
        }
        r
    };
    let mut responses = problem_responses();
    responses["200"] = ok;
    let mut op = json!({
        "operationId": route.name,
        "summary": summary(route.doc),
        "description": description(route.doc),
        "tags": [tag(route.path)],
        "x-forkfleet-access": route.access.as_str(),
        "parameters": parameters,
        "responses": responses,
    });
    if route.method != "GET" && !body_props.is_empty() {
        op["requestBody"] = json!({
            "required": !body_required.is_empty(),
            "content": { "application/json": { "schema": {
                "type": "object", "properties": body_props, "required": body_required
            } } }
        });
    }
    op
}

fn tag(path: &str) -> String {
    path.trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or("api")
        .to_string()
}

/// The routes of `stream` as the document has them.
fn extra_paths(paths: &mut Map<String, Value>) {
    let id = |name: &str, format: &str| json!({ "name": name, "in": "path", "required": true, "schema": { "type": "string", "format": format } });
    let last = json!({ "name": "Last-Event-ID", "in": "header", "required": false, "schema": { "type": "string" }, "description": "Resume after this event" });
    let ticket = json!({ "name": "ticket", "in": "query", "required": false, "schema": { "type": "string" }, "description": "A ticket from POST /stream-tickets, for a client that cannot send the Authorization header (an EventSource)" });
    let sse = |what: &str| json!({ "description": what, "content": { "text/event-stream": { "schema": { "type": "string" } } } });
    let mut add = |path: String, method: &str, op: Value| {
        let entry = paths.entry(path).or_insert_with(|| json!({}));
        entry[method] = op;
    };
    let with_problems = |ok: Value| {
        let mut r = problem_responses();
        r["200"] = ok;
        r
    };
    add(
        format!("{PREFIX}/forks/{{fork}}/stream"),
        "get",
        json!({
            "operationId": "fork_stream", "summary": "A fork's changes as Server-Sent Events", "tags": ["forks"],
            "x-forkfleet-access": "read", "parameters": [id("fork", "uuid"), last.clone(), ticket.clone()],
            "responses": with_problems(sse("first a `fork` event, the whole state: {version, view, cost}; then `delta` events, {version, view, cost} with only the fields and `branches` rows (keyed by position) that changed (docs/HTTP.md); the id is the coordinator's start in ms times 10^6 plus the version")),
        }),
    );
    add(
        format!("{PREFIX}/runs/{{run}}/stream"),
        "get",
        json!({
            "operationId": "run_stream", "summary": "A run's events as Server-Sent Events", "tags": ["runs"],
            "x-forkfleet-access": "read", "parameters": [id("run", "uuid"), last, ticket],
            "responses": with_problems(sse("`event` events: {seq, event}; the id is the seq")),
        }),
    );
    let mut put = problem_responses();
    put["204"] = json!({ "description": "Stored" });
    add(
        format!("{PREFIX}/blobs/{{blob}}"),
        "put",
        json!({
            "operationId": "put_blob", "summary": "Store bytes under their SHA-256", "tags": ["blobs"],
            "x-forkfleet-access": "write",
            "parameters": [{ "name": "blob", "in": "path", "required": true, "schema": { "type": "string", "pattern": "^[0-9a-f]{64}$" } }],
            "requestBody": { "required": true, "content": { "application/octet-stream": { "schema": { "type": "string", "contentMediaType": "application/octet-stream" } } } },
            "responses": put,
        }),
    );
    let mut made = problem_responses();
    made["200"] = json!({ "description": "The new fork", "content": { "application/json": { "schema": { "x-rust-type": "ForkView" } } } });
    add(
        format!("{PREFIX}/forks/from-spec"),
        "post",
        json!({
            "operationId": "create_fork_from_spec", "summary": "A fork from a spec document and an uploaded snapshot or a run", "tags": ["forks"],
            "x-forkfleet-access": "write",
            "requestBody": { "required": true, "content": { "application/json": { "schema": {
                "type": "object",
                "properties": {
                    "spec": { "type": "string", "description": "The spec file's TOML (docs/SPEC.md)" },
                    "files": { "type": "object", "additionalProperties": { "type": "string" }, "description": "Files the spec names, by relative path" },
                    "snapshot": { "type": "string", "pattern": "^[0-9a-f]{64}$" },
                    "run": { "type": "string", "format": "uuid" },
                    "workspace": { "type": "string" }
                },
                "required": ["spec"]
            } } } },
            "responses": made,
        }),
    );
    add(
        format!("{PREFIX}/stream-tickets"),
        "post",
        json!({
            "operationId": "stream_ticket", "summary": "A ticket admitting the caller's GET .../stream for a minute, for an EventSource's URL (a token never goes in a URL)", "tags": ["api"],
            "x-forkfleet-access": "read",
            "responses": with_problems(json!({ "description": "The ticket", "content": { "application/json": { "schema": {
                "type": "object",
                "properties": { "ticket": { "type": "string" }, "expires_in_s": { "type": "integer" } },
                "required": ["ticket", "expires_in_s"]
            } } } })),
        }),
    );
    add(
        format!("{PREFIX}/openapi.json"),
        "get",
        json!({
            "operationId": "openapi", "summary": "This document", "tags": ["api"], "security": [],
            "responses": { "200": { "description": "The OpenAPI document", "content": { "application/json": { "schema": { "type": "object" } } } } },
        }),
    );
}

/// The whole document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for route in ROUTES {
        let entry = paths
            .entry(format!("{PREFIX}{}", route.path))
            .or_insert_with(|| json!({}));
        entry[route.method.to_lowercase()] = operation(route);
    }
    extra_paths(&mut paths);
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "forkfleet",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Fork one agent run into many branches, judge them, merge the winner. Every operation of the coordinator's API (docs/API.md), over HTTP (docs/HTTP.md).",
        },
        "servers": [{ "url": "/" }],
        "security": [{ "bearer": [] }],
        "paths": paths,
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": {
                "Problem": {
                    "type": "object",
                    "properties": {
                        "type": { "type": "string" },
                        "title": { "type": "string" },
                        "status": { "type": "integer" },
                        "detail": { "type": "string" },
                        "kind": { "type": "string", "enum": ["bad_input", "not_found", "conflict", "unavailable", "failure", "unauthorized", "forbidden"] }
                    },
                    "required": ["type", "title", "status", "detail"]
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_is_in_the_document_with_its_fields() {
        let doc = document();
        for r in ROUTES {
            let op = &doc["paths"][format!("{PREFIX}{}", r.path)][r.method.to_lowercase()];
            assert_eq!(op["operationId"], r.name, "{r:?}");
        }
        let steer = &doc["paths"]["/api/v1/forks/{fork}/branches/{label}/steer"]["post"];
        assert_eq!(
            steer["requestBody"]["content"]["application/json"]["schema"]["required"],
            json!(["text"])
        );
        assert_eq!(steer["x-forkfleet-access"], "write");
        let forks = &doc["paths"]["/api/v1/forks"]["get"];
        assert!(forks["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "limit"));
        assert_eq!(
            schema_of("Option < u64 >"),
            (json!({"type": "integer", "minimum": 0}), true)
        );
    }
}

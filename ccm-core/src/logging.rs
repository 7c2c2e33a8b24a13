//! Logging: human-readable text, or JSON in the shape of klog's JSON format (upstream's
//! `--logging-format=json`), so that a log pipeline built for upstream's
//! cloud-controller-manager parses ours:
//!
//! ```json
//! {"ts":1764844800.123,"caller":"controllers/node.rs:201","msg":"Node synced","v":0,"node":{"name":"node-a"}}
//! {"ts":1764844801.5,"caller":"controllers/service/mod.rs:370","msg":"sync failed","err":"…","service":{"name":"web","namespace":"default"}}
//! ```
//!
//! - `ts`: seconds since the epoch, a float; `caller`: source file and line; `msg`: the message.
//! - `v`: klog's verbosity of info records (0 for info, 4 debug, 5 trace, as `--v` maps onto
//!   levels); error records carry none, as klog's.
//! - `err`: the error (ours is the field `error`).
//! - Object references as klog's `KObj`: `{"name","namespace"}` for namespaced objects written
//!   `namespace/name` (`service`, `service_key`, `lease`, `object`), `{"name"}` for a `node`.
//! - Every other field, and the fields of the spans the record is in (the controller, the
//!   object), as keys of their own.

use std::fmt::Write as _;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// The log output: `text` or `json` (klog's keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

/// Installs the process's logger on stderr, filtered by `filter` (RUST_LOG syntax).
pub fn init(format: Format, filter: &str) {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::new(filter);
    match format {
        Format::Json => tracing_subscriber::registry().with(KlogJson::new(std::io::stderr)).with(filter).init(),
        Format::Text => tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init(),
    }
}

/// The klog-shaped JSON layer; `W` makes the writer of each record.
pub struct KlogJson<W> {
    make_writer: W,
}

impl<W, O> KlogJson<W>
where
    W: Fn() -> O,
    O: std::io::Write,
{
    pub fn new(make_writer: W) -> Self {
        Self { make_writer }
    }
}

/// A span's fields, kept in its extensions until the span closes.
struct SpanFields(Map<String, Value>);

impl<S, W, O> Layer<S> for KlogJson<W>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: Fn() -> O + 'static,
    O: std::io::Write,
{
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, id: &tracing::span::Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields.map));
        }
    }

    fn on_record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut extensions = span.extensions_mut();
        if let Some(SpanFields(map)) = extensions.get_mut::<SpanFields>() {
            let mut fields = Fields { map: std::mem::take(map), message: None };
            values.record(&mut fields);
            *map = fields.map;
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut spans = Map::new();
        if let Some(scope) = ctx.event_scope(event) {
            // Outermost first, so that an inner span's field wins.
            for span in scope.from_root() {
                if let Some(SpanFields(map)) = span.extensions().get::<SpanFields>() {
                    spans.extend(map.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
            }
        }
        let line = record(event.metadata(), fields, spans, now_seconds());
        let mut out = (self.make_writer)();
        // A log line that cannot be written has nowhere else to go.
        let _ = out.write_all(line.as_bytes());
    }
}

fn now_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// klog's verbosity of a record at `level`; none for errors.
fn verbosity(level: &Level) -> Option<u8> {
    match *level {
        Level::ERROR => None,
        Level::WARN | Level::INFO => Some(0),
        Level::DEBUG => Some(4),
        Level::TRACE => Some(5),
    }
}

/// One record, a line of JSON.
fn record(meta: &tracing::Metadata<'_>, fields: Fields, spans: Map<String, Value>, ts: f64) -> String {
    let mut out = Map::new();
    out.insert("ts".into(), Value::from(ts));
    let file = meta.file().map(|f| f.strip_prefix("ccm-core/src/").or_else(|| f.strip_prefix("src/")).unwrap_or(f));
    if let (Some(file), Some(line)) = (file, meta.line()) {
        out.insert("caller".into(), Value::from(format!("{file}:{line}")));
    }
    out.insert("msg".into(), Value::from(fields.message.unwrap_or_default()));
    if let Some(v) = verbosity(meta.level()) {
        out.insert("v".into(), Value::from(v));
    }
    for (key, value) in spans.into_iter().chain(fields.map) {
        let (key, value) = klog_field(key, value);
        out.insert(key, value);
    }
    let mut line = Value::Object(out).to_string();
    line.push('\n');
    line
}

/// A field as klog writes it: `error` as `err`, object names as `KObj` references.
fn klog_field(key: String, value: Value) -> (String, Value) {
    match (key.as_str(), value) {
        ("error", value) => ("err".into(), value),
        ("node", Value::String(name)) => (key, object_ref(None, name)),
        ("service" | "service_key" | "lease" | "object", Value::String(text)) => match text.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() && !name.contains('/') => {
                let key = if key == "service_key" { "service".into() } else { key };
                (key, object_ref(Some(namespace.to_string()), name.to_string()))
            }
            _ => (key, Value::String(text)),
        },
        (_, value) => (key, value),
    }
}

fn object_ref(namespace: Option<String>, name: String) -> Value {
    let mut map = Map::new();
    map.insert("name".into(), Value::String(name));
    if let Some(namespace) = namespace {
        map.insert("namespace".into(), Value::String(namespace));
    }
    Value::Object(map)
}

/// Collects a record's or span's fields as JSON values.
#[derive(Default)]
struct Fields {
    map: Map<String, Value>,
    message: Option<String>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let mut text = String::new();
        let _ = write!(text, "{value:?}");
        self.put(field, Value::String(text));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::String(value.to_string()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::from(value));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::String(value.to_string()));
    }
}

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(match value {
                Value::String(s) => s,
                other => other.to_string(),
            });
        } else {
            self.map.insert(field.name().trim_start_matches("r#").to_string(), value);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::prelude::*;

    use super::*;

    /// The records a closure logs, parsed.
    fn records(f: impl FnOnce()) -> Vec<Value> {
        let buffer = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = buffer.clone();
        let layer = KlogJson::new(move || Sink(sink.clone()));
        let subscriber = tracing_subscriber::registry().with(layer).with(tracing_subscriber::filter::LevelFilter::TRACE);
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buffer.lock().expect("buffer").clone()).expect("utf-8");
        text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
    }

    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn records_carry_klogs_keys() {
        let out = records(|| {
            let span = tracing::info_span!("reconcile", controller = "service-lb-controller");
            let _in = span.enter();
            tracing::info!(node = "node-a", count = 3, "Node synced");
            tracing::debug!(service = "default/web", "ensuring");
            let error = std::io::Error::other("the cloud said no");
            tracing::error!(error = %error, service_key = "ns/api", "sync failed");
        });
        assert_eq!(out.len(), 3);
        let info = &out[0];
        assert!(info["ts"].as_f64().is_some_and(|t| t > 1.7e9), "{info}");
        assert_eq!(info["msg"], "Node synced");
        assert_eq!(info["v"], 0);
        assert_eq!(info["node"], serde_json::json!({"name": "node-a"}));
        assert_eq!(info["count"], 3);
        assert_eq!(info["controller"], "service-lb-controller");
        assert!(info["caller"].as_str().is_some_and(|c| c.starts_with("logging.rs:")), "{info}");
        assert_eq!(out[1]["v"], 4);
        assert_eq!(out[1]["service"], serde_json::json!({"name": "web", "namespace": "default"}));
        let error = &out[2];
        assert_eq!(error["err"], "the cloud said no");
        assert!(error.get("v").is_none() && error.get("error").is_none(), "{error}");
        assert_eq!(error["service"], serde_json::json!({"name": "api", "namespace": "ns"}));
    }
}

//! Logging: the library's `tracing` events, one line each on stderr
//! (JSON lines under `--json`), filtered by `RUST_LOG`.
//!
//! The default filter shows a target's events (listening, peers refused,
//! connections closed for a bad frame, ...) at `info` for the workspace's
//! crates and `warn` for dependencies; the other commands log nothing by
//! default, so a failure stays one line (set `RUST_LOG` to see more).
//! Stdout (the report, the target's address) never carries log lines.

use std::fmt;
use std::io::IsTerminal;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// Default filter of `kvmove target`.
pub const TARGET_DEFAULT: &str =
    "warn,kvmove=info,kvmove_policy=info,transport_core=info,transport_tcp=info,transport_rdma=info,\
                                  transport_etcd=info,transport_mock=info";
/// Default filter of the other commands: nothing.
pub const QUIET_DEFAULT: &str = "off";

/// Installs the subscriber. `RUST_LOG` wins over `default` when it is set;
/// an unparsable `RUST_LOG` is reported in one line and `default` used.
pub fn init(default: &str, json: bool) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => match EnvFilter::builder().parse(&v) {
            Ok(f) => f,
            Err(e) => {
                crate::say!("kvmove: warning: RUST_LOG={v:?} is not a valid filter ({e}); using {default:?}");
                EnvFilter::new(default)
            }
        },
        _ => EnvFilter::new(default),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second subscriber (tests) is not an error worth a line.
    let _ = if json {
        builder.event_format(JsonLine).try_init()
    } else {
        builder.with_ansi(std::io::stderr().is_terminal()).try_init()
    };
}

/// One JSON object per event: `ts` (Unix seconds), `level`, `target`,
/// `message` and the event's fields, and the enclosing spans' names.
struct JsonLine;

impl<S, N> FormatEvent<S, N> for JsonLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let meta = event.metadata();
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut obj = serde_json::Map::new();
        obj.insert("ts".into(), serde_json::json!(ts));
        obj.insert("level".into(), meta.level().as_str().into());
        obj.insert("target".into(), meta.target().into());
        let mut fields = Fields(serde_json::Map::new());
        event.record(&mut fields);
        for (k, v) in fields.0 {
            obj.entry(k).or_insert(v);
        }
        if let Some(scope) = ctx.event_scope() {
            let spans: Vec<serde_json::Value> = scope.from_root().map(|s| s.name().into()).collect();
            if !spans.is_empty() {
                obj.insert("spans".into(), spans.into());
            }
        }
        writeln!(w, "{}", serde_json::Value::Object(obj))
    }
}

/// An event's fields as JSON values.
struct Fields(serde_json::Map<String, serde_json::Value>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
}

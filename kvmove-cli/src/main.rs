//! The `kvmove` command: a KV-cache-shaped transfer benchmark (`bench`, the
//! default), a target that serves memory (`target`), an initiator that
//! runs the workload against it (`initiator`), `config`, the handoff
//! scenario (`handoff`), a live view of a running engine (`top`), one
//! engine of a prefill/decode cluster (`pd`) and the host's device layout
//! (`topology`): `args.rs` says what each takes.
//!
//! Every failure ends in one line on stderr and a non-zero exit: 1 for a
//! failed run (peer unreachable, transfer failed), 2 for a usage or config
//! error, 3 when bytes did not verify. A panic prints one line too.
#![forbid(unsafe_code)]

/// `eprintln!` that ignores a closed stderr instead of panicking.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod args;
mod commands;
mod data;
mod handoff;
mod log;
mod metrics;
mod pd;
mod plan;
mod report;
mod run;
mod sessions;
mod settings;
mod top;
mod topology;

use std::process::ExitCode;

use clap::Parser as _;

use crate::args::{Cli, Command};
use crate::commands::Outcome;

fn main() -> ExitCode {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        crate::say!("kvmove: internal error: {}{at}; please report it", one_line(&msg));
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // One line, like every other error: clap's text without the hint.
            let text = e.to_string();
            let msg: Vec<&str> =
                text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with("For more information")).collect();
            let msg = one_line(&msg.join(" "));
            crate::say!(
                "kvmove: error: {} (see kvmove --help)",
                msg.trim_start_matches("error: ").replace("error: ", "")
            );
            return ExitCode::from(2);
        }
    };
    let default_filter = match cli.command {
        Some(Command::Target | Command::Pd(_)) => log::TARGET_DEFAULT,
        _ => log::QUIET_DEFAULT,
    };
    log::init(default_filter, cli.opts.json);
    let settings = match cli.opts.settings() {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            crate::say!("kvmove: error: cannot start the async runtime: {}", one_line(&e.to_string()));
            return ExitCode::from(1);
        }
    };
    let json = cli.opts.json;
    if !cli.opts.no_metrics {
        if let Err(e) = runtime.block_on(async { metrics::install(cli.opts.metrics) }) {
            crate::say!("kvmove: error: {}", one_line(&e));
            return ExitCode::from(2);
        }
    } else if cli.opts.metrics.is_some() {
        crate::say!("kvmove: error: --metrics and --no-metrics exclude each other");
        return ExitCode::from(2);
    }
    let result = runtime.block_on(async {
        match &cli.command {
            None | Some(Command::Bench) => commands::bench(&settings, json).await,
            Some(Command::Target) => commands::target(&settings, json).await,
            Some(Command::Initiator(a)) => commands::initiator(&settings, &a.target, json).await,
            Some(Command::Config) => commands::config(&settings),
            Some(Command::Handoff(a)) => commands::handoff(&settings, a, json).await,
            Some(Command::Pd(a)) => pd::run(&settings, a).await,
            Some(Command::Topology(a)) => topology::run(a, json),
            Some(Command::Top(a)) => {
                let (addr, every, count) = (a.url, std::time::Duration::from_millis(a.interval_ms), a.count);
                tokio::task::spawn_blocking(move || top::run(addr, every, count))
                    .await
                    .unwrap_or_else(|e| Err(kvmove::Error::new(kvmove::ErrorKind::Internal, e.to_string())))
                    .map(|()| Outcome::Ok)
            }
        }
    });
    // Do not wait for background tasks of a failed backend.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Mismatch(msg)) => {
            crate::say!("kvmove: error: {}", one_line(&msg));
            ExitCode::from(3)
        }
        Err(e) => fail(&e),
    }
}

fn fail(e: &kvmove::Error) -> ExitCode {
    crate::say!("kvmove: error: {}", one_line(&e.to_string()));
    if e.kind() == kvmove::ErrorKind::Config {
        ExitCode::from(2)
    } else {
        ExitCode::from(1)
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

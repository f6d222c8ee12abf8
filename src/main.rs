//! The `dpcoord` command: parse flags and config, then serve, check or demo.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dpcoord::config::{self, Config, ConfigError, LogFormat};
use dpcoord::io::daemon::Daemon;
use dpcoord::io::http;

#[derive(Parser, Debug)]
#[command(
    name = "dpcoord",
    version,
    about = "Data-parallel rank coordinator for LLM serving",
    allow_negative_numbers = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// TOML config file; flags override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Number of DP ranks (engines.dp_size).
    #[arg(long, value_name = "N")]
    dp_size: Option<i64>,
    /// User routing policy (routing.policy).
    #[arg(long, value_name = "NAME")]
    policy: Option<String>,
    /// ROUTER endpoint for routing queries (server.route_bind).
    #[arg(long, value_name = "EP")]
    route_bind: Option<String>,
    /// ROUTER endpoint for health queries (server.health_bind).
    #[arg(long, value_name = "EP")]
    health_bind: Option<String>,
    /// SUB bind endpoint for engine stats, "" to disable (server.stats_bind).
    #[arg(long, value_name = "EP")]
    stats_bind: Option<String>,
    /// Engine PUB endpoint to connect to; repeatable (server.stats_connect).
    #[arg(long = "stats-connect", value_name = "EP")]
    stats_connect: Vec<String>,
    /// HTTP listener for metrics and probes (server.metrics_bind).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_bind: Option<String>,
    /// Tick period in ms (routing.tick_ms).
    #[arg(long, value_name = "MS")]
    tick_ms: Option<i64>,
    /// engines.stale_after_ms
    #[arg(long, value_name = "MS")]
    stale_after_ms: Option<i64>,
    /// engines.down_after_ms
    #[arg(long, value_name = "MS")]
    down_after_ms: Option<i64>,
    /// routing.pending_ttl_ms
    #[arg(long, value_name = "MS")]
    pending_ttl_ms: Option<i64>,
    /// text or json (server.log_format).
    #[arg(long, value_name = "FORMAT")]
    log_format: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Check a config file and exit (0 when valid, 2 with the bad key otherwise).
    CheckConfig { file: PathBuf },
    #[cfg(feature = "sim")]
    /// Run dpcoord with 8 simulated engines, 2 frontends and a health prober, showing a live table.
    Demo(dpcoord::sim::demo::DemoArgs),
    #[cfg(feature = "sim")]
    /// Run a simulation scenario; prints a report and writes it with an SVG chart.
    Sim(dpcoord::sim::SimArgs),
}

fn read_file(path: &PathBuf) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError { key: "config".into(), problem: format!("cannot read {}: {e}", path.display()) })?;
    Config::parse_toml(&text)
}

impl Cli {
    /// The file's table with every given flag folded in.
    fn table(&self) -> Result<toml::Table, ConfigError> {
        let mut t = match &self.config {
            Some(path) => read_file(path)?,
            None => toml::Table::new(),
        };
        let ints = [
            ("engines", "dp_size", self.dp_size),
            ("routing", "tick_ms", self.tick_ms),
            ("engines", "stale_after_ms", self.stale_after_ms),
            ("engines", "down_after_ms", self.down_after_ms),
            ("routing", "pending_ttl_ms", self.pending_ttl_ms),
        ];
        for (section, key, value) in ints {
            if let Some(v) = value {
                config::set(&mut t, section, key, toml::Value::Integer(v));
            }
        }
        let strings = [
            ("routing", "policy", &self.policy),
            ("server", "route_bind", &self.route_bind),
            ("server", "health_bind", &self.health_bind),
            ("server", "stats_bind", &self.stats_bind),
            ("server", "metrics_bind", &self.metrics_bind),
            ("server", "log_format", &self.log_format),
        ];
        for (section, key, value) in strings {
            if let Some(v) = value {
                config::set(&mut t, section, key, toml::Value::String(v.clone()));
            }
        }
        if !self.stats_connect.is_empty() {
            let eps = self.stats_connect.iter().cloned().map(toml::Value::String).collect();
            config::set(&mut t, "server", "stats_connect", toml::Value::Array(eps));
        }
        Ok(t)
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Waits for SIGTERM, SIGINT, or the daemon ending on its own.
async fn wait_for_stop(daemon: &Daemon) -> std::io::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut poll = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = term.recv() => return Ok("SIGTERM"),
            _ = int.recv() => return Ok("SIGINT"),
            _ = poll.tick() => if daemon.is_finished() { return Ok("coordinator ended") },
        }
    }
}

fn serve(cfg: Config) -> ExitCode {
    init_logging(cfg.server.log_format);
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dpcoord: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let listener = match http::bind(cfg.server.metrics_bind) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("dpcoord: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let daemon = match Daemon::start(&cfg) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("dpcoord: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let web = http::spawn(rt.handle(), listener, daemon.registry.clone(), daemon.published.clone());
    tracing::info!(metrics = %cfg.server.metrics_bind, "HTTP serving /metrics /healthz /readyz /state");
    match rt.block_on(wait_for_stop(&daemon)) {
        Ok(why) => tracing::info!(reason = why, "stopping"),
        Err(e) => tracing::error!(error = %e, "cannot wait for signals; stopping"),
    }
    // Both wind down at once, so shutdown takes the longer of the two, not the sum.
    let (web, coordinator) =
        rt.block_on(async { tokio::join!(web.stop(), tokio::task::spawn_blocking(move || daemon.stop())) });
    if let Err(e) = web {
        tracing::warn!(error = %e, "HTTP server did not stop cleanly");
    }
    let coordinator = match coordinator {
        Ok(stopped) => stopped,
        Err(join) => {
            eprintln!("dpcoord: error: the coordinator failed while stopping: {join}");
            return ExitCode::FAILURE;
        }
    };
    match coordinator {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dpcoord: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn config_error(e: ConfigError) -> ExitCode {
    eprintln!("dpcoord: error: {e}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            // One line naming the flag, as for config keys.
            let text = e.to_string();
            eprintln!("dpcoord: {}", text.lines().next().unwrap_or("invalid command line"));
            return ExitCode::from(2);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    match &cli.cmd {
        #[cfg(feature = "sim")]
        Some(Cmd::Demo(args)) => dpcoord::sim::demo::main(args),
        #[cfg(feature = "sim")]
        Some(Cmd::Sim(args)) => dpcoord::sim::main(args),
        Some(Cmd::CheckConfig { file }) => match read_file(file).and_then(Config::from_table) {
            Ok(_) => {
                println!("{}: ok", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => config_error(e),
        },
        None => match cli.table().and_then(Config::from_table) {
            Ok(cfg) => serve(cfg),
            Err(e) => config_error(e),
        },
    }
}

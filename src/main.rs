//! The `dpcoord` command: parse flags and config, then serve, check or demo.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use dpcoord_daemon::config::{self, Config, ConfigError, LogFormat};
use dpcoord_daemon::io::daemon::Daemon;
use dpcoord_daemon::io::reload::ConfigSource;
use dpcoord_daemon::io::sockets::TransportError;
use dpcoord_daemon::io::{http, ipc};

/// The command's own arguments; the config flags (`--dp-size`, ...) are
/// added from the key specs by [`command_line`].
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
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Check a config file and exit (0 when valid, 2 with the bad key otherwise).
    CheckConfig {
        /// The TOML config file to check, as `--config FILE` would read it
        /// (no flags are folded in).
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// GET /healthz (or /readyz) of a running dpcoord: exit 0 on 200, 1 otherwise, 2 on a bad URL.
    Probe(dpcoord_daemon::io::probe::ProbeArgs),
    /// Serve an OpenAI-compatible proxy in front of one server per rank (vLLM or vLLM Ascend with
    /// external data parallelism, SGLang, any OpenAI-compatible engine): each request goes to the rank
    /// dpcoord picks. Takes the daemon's flags too (`--policy`, ...).
    #[cfg(feature = "gateway")]
    Proxy(ProxyArgs),
    #[cfg(feature = "sim")]
    /// Run 8 simulated engines, frontends and a health prober in three phases (a stale snapshot,
    /// vLLM's rule, then through dpcoord), showing dpcoord's live table.
    Demo(dpcoord_sim::demo::DemoArgs),
    #[cfg(feature = "sim")]
    /// Run a simulation scenario; prints a report and writes it with an SVG chart.
    Sim(dpcoord_sim::SimArgs),
}

/// `dpcoord proxy`'s own arguments; the daemon's flags are added by [`command_line`].
#[derive(clap::Args, Debug, Clone)]
struct ProxyArgs {
    /// TOML config file; flags and the arguments below override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where the proxy listens (server.proxy_bind).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:8000")]
    listen: String,
    /// Each rank's server, `http://HOST:PORT` or `HOST:PORT`, in rank order: sets engines.dp_size and
    /// gateway.endpoints, and, unless a load source is configured (`--vllm-metrics-url`,
    /// `--sglang-load-connect`, `--stats-connect`), each server's /metrics is read as vLLM's. None: the config
    /// file's gateway.endpoints.
    #[arg(value_name = "SERVER")]
    servers: Vec<String>,
}

/// The name of the subcommand that also takes the daemon's flags.
const PROXY: &str = "proxy";

/// Parses the command line: the command's own arguments and the config flags.
fn command_line() -> Result<(Cli, ArgMatches), clap::Error> {
    let mut cmd = Cli::command().args(config::flags());
    if cfg!(feature = "gateway") {
        cmd = cmd.mut_subcommand(PROXY, |s| s.args(config::flags()));
    }
    let matches = cmd.try_get_matches_from_mut(std::env::args_os()).map_err(|e| with_values(e, &cmd))?;
    if let Some(sub) = matches.subcommand_name() {
        // The daemon's flags before a subcommand would be silently ignored.
        let given: Vec<String> = matches
            .ids()
            .filter_map(|id| cmd.get_arguments().find(|a| a.get_id() == id)?.get_long())
            .map(|long| format!("--{long}"))
            .collect();
        if !given.is_empty() {
            let msg = format!(
                "{} {} the daemon's; `dpcoord {sub}` does not read {} (see `dpcoord {sub} --help`)",
                given.join(", "),
                if given.len() == 1 { "is" } else { "are" },
                if given.len() == 1 { "it" } else { "them" },
            );
            return Err(cmd.error(clap::error::ErrorKind::ArgumentConflict, msg));
        }
    }
    let cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))?;
    Ok((cli, matches))
}

/// clap names a missing argument but not its values: one that has a list
/// (`dpcoord sim`'s scenario) gets it as a tip, as an invalid value does.
fn with_values(mut e: clap::Error, cmd: &clap::Command) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let Some(ContextValue::Strings(missing)) = e.get(ContextKind::InvalidArg) else { return e };
    if e.kind() != ErrorKind::MissingRequiredArgument {
        return e;
    }
    let tips: Vec<clap::builder::StyledStr> = cmd
        .get_subcommands()
        .flat_map(clap::Command::get_positionals)
        .filter(|arg| missing.contains(&arg.to_string()))
        .filter_map(|arg| {
            let values: Vec<String> = arg.get_possible_values().iter().map(|v| v.get_name().to_owned()).collect();
            (!values.is_empty()).then(|| format!("{arg} is one of: {}", values.join(", ")).into())
        })
        .collect();
    if !tips.is_empty() {
        e.insert(ContextKind::Suggested, ContextValue::StyledStrs(tips));
    }
    e
}

/// Where the configuration is read from, at start and again on a reload:
/// the file, the flags, and `dpcoord proxy`'s arguments.
#[derive(Clone)]
struct Sources {
    config: Option<PathBuf>,
    matches: ArgMatches,
    proxy: Option<ProxyArgs>,
}

impl Sources {
    /// The file's table with every given flag (and proxy argument) folded in.
    fn table(&self) -> Result<toml::Table, ConfigError> {
        let mut t = match &self.config {
            Some(path) => config::read_file(path)?,
            None => toml::Table::new(),
        };
        config::fold_flags(&self.matches, &mut t);
        if let Some(p) = &self.proxy {
            config::fold_proxy_args(&mut t, &p.listen, &p.servers)?;
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

/// Waits for SIGTERM, SIGINT, or the daemon ending on its own; SIGHUP
/// asks the daemon to reload its configuration and waits on. Every other
/// signal that would end the process is logged and ignored
/// ([`dpcoord_daemon::io::signals`]). All handlers are installed before the first
/// await, so once the HTTP server answers (it runs inside this wait), they are.
async fn wait_for_stop(daemon: &Daemon) -> std::io::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    dpcoord_daemon::io::signals::ignore_the_rest()?;
    let mut poll = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = term.recv() => return Ok("SIGTERM"),
            _ = int.recv() => return Ok("SIGINT"),
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading the configuration");
                daemon.request_reload();
            }
            _ = poll.tick() => if daemon.is_finished() { return Ok("coordinator ended") },
        }
    }
}

/// Why the daemon failed: its one line and exit status (2 when an endpoint
/// of the configuration can never be bound, 1 otherwise).
struct Failed {
    why: String,
    code: u8,
}

impl From<String> for Failed {
    fn from(why: String) -> Failed {
        Failed { why, code: 1 }
    }
}

/// The failure of a bind or listen: exit 2 when the configuration is at fault.
fn bind_failed(e: impl std::fmt::Display, config: bool) -> Failed {
    Failed { why: e.to_string(), code: if config { 2 } else { 1 } }
}

/// Serves until a signal or the coordinator's end.
fn serve(cfg: Config, source: ConfigSource) -> Result<(), Failed> {
    init_logging(cfg.server.log_format);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let listener =
        http::bind(cfg.server.metrics_bind).map_err(|e| bind_failed(&e, ipc::listen_is_config_error(&e.source)))?;
    let fronts = fronts::ready(&cfg)?;
    let daemon = Daemon::start(&cfg, source, fronts::local(&fronts)).map_err(|e| {
        let config =
            matches!(&e, TransportError::Endpoint { what: "bind", source, .. } if ipc::bind_is_config_error(source));
        bind_failed(&e, config)
    })?;
    let fronts = fronts::start(fronts, rt.handle(), &cfg, &daemon)?;
    let web = http::spawn(rt.handle(), listener, daemon.registry.clone(), daemon.published.clone(), daemon.http);
    tracing::info!(metrics = %cfg.server.metrics_bind, "HTTP serving /metrics /healthz /readyz /state");
    match rt.block_on(wait_for_stop(&daemon)) {
        Ok(why) => tracing::info!(reason = why, "stopping"),
        Err(e) => tracing::error!(error = %e, "cannot wait for signals; stopping"),
    }
    // Not ready from now on (`/readyz`, the picker's health); then the
    // fronts, while the coordinator still books their requests' ends.
    daemon.published.set_stopping();
    rt.block_on(fronts::stop(fronts));
    // Both wind down at once, so shutdown takes the longer of the two, not the sum.
    let (web, coordinator) =
        rt.block_on(async { tokio::join!(web.stop(), tokio::task::spawn_blocking(move || daemon.stop())) });
    if let Err(e) = web {
        tracing::warn!(error = %e, "HTTP server did not stop cleanly");
    }
    coordinator.map_err(|join| format!("the coordinator failed while stopping: {join}"))?.map_err(|e| e.to_string())?;
    tracing::info!("stopped");
    Ok(())
}

/// Reads the configuration again as at start: the same file, the same
/// flags. Without a file there is nothing to re-read: a reload is refused.
fn reloader(sources: Sources) -> ConfigSource {
    match sources.config.clone() {
        Some(path) => {
            ConfigSource::new(path.display().to_string(), move || sources.table().and_then(Config::from_table))
        }
        None => ConfigSource::none(),
    }
}

/// Serves the daemon on the configuration `sources` give.
fn run(sources: Sources) -> ExitCode {
    match sources.table().and_then(Config::from_table) {
        Ok(cfg) => match serve(cfg, reloader(sources)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(Failed { why, code }) => fail(why, ExitCode::from(code)),
        },
        Err(e) => fail(e, ExitCode::from(2)),
    }
}

/// Prints `e` as dpcoord's one error line and exits with `code`.
fn fail(e: impl std::fmt::Display, code: ExitCode) -> ExitCode {
    eprintln!("dpcoord: error: {e}");
    code
}

fn main() -> ExitCode {
    let (cli, matches) = match command_line() {
        Ok(parsed) => parsed,
        Err(e) if e.use_stderr() => {
            // clap's whole message (`error: ...` naming the argument, then
            // the valid values or a tip, and the usage), as one block.
            eprint!("dpcoord: ");
            let _ = e.print();
            return ExitCode::from(2);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    match &cli.cmd {
        #[cfg(feature = "sim")]
        Some(Cmd::Demo(args)) => dpcoord_sim::demo::main(args),
        #[cfg(feature = "sim")]
        Some(Cmd::Sim(args)) => dpcoord_sim::main(args),
        Some(Cmd::Probe(args)) => dpcoord_daemon::io::probe::main(args),
        Some(Cmd::CheckConfig { file }) => {
            match config::read_file(file).and_then(Config::from_table).and_then(|cfg| fronts::check(&cfg).map(|()| cfg))
            {
                Ok(cfg) => {
                    println!("{}: ok", file.display());
                    println!("{}", config::budget::describe(&cfg.settings.memory, cfg.settings.engines.dp_size));
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e, ExitCode::from(2)),
            }
        }
        #[cfg(feature = "gateway")]
        Some(Cmd::Proxy(args)) => {
            let matches = matches.subcommand_matches(PROXY).cloned().unwrap_or_default();
            // `dpcoord --config FILE proxy ...` reads FILE as well.
            let config = args.config.clone().or_else(|| cli.config.clone());
            run(Sources { config, matches, proxy: Some(args.clone()) })
        }
        None => run(Sources { config: cli.config.clone(), matches, proxy: None }),
    }
}

/// The gateway's fronts (crates/gateway), when the command is built with
/// them (the `gateway` feature, on by default).
#[cfg(feature = "gateway")]
mod fronts {
    use dpcoord_daemon::config::keys::{StrKey, EPP_BIND, PROXY_BIND};
    use dpcoord_daemon::config::{Config, ConfigError};
    use dpcoord_daemon::io::daemon::Daemon;
    use dpcoord_daemon::io::ipc;
    use dpcoord_daemon::io::sockets::Local;
    use dpcoord_gateway::{Fronts, Ready};

    use super::{bind_failed, Failed};

    /// The fronts' listeners bound and the model's tokenizer read before
    /// anything serves: a busy port or a file that does not load stops the
    /// start, naming its key.
    pub fn ready(cfg: &Config) -> Result<Ready, Failed> {
        let (epp, proxy) = (listen(cfg.server.epp_bind, &EPP_BIND)?, listen(cfg.server.proxy_bind, &PROXY_BIND)?);
        // A configuration error (naming its key): the exit code of one.
        Ready::new(cfg, epp, proxy).map_err(|e| Failed { why: e.to_string(), code: 2 })
    }

    /// A front's listener, bound before the daemon starts (a busy port stops
    /// the start, naming `key`); `None` when the front is off.
    fn listen(bind: Option<std::net::SocketAddr>, key: &StrKey) -> Result<Option<std::net::TcpListener>, Failed> {
        let Some(addr) = bind else { return Ok(None) };
        let listener = std::net::TcpListener::bind(addr).map_err(|e| {
            let why = format!("cannot listen on {addr} ({}): {e}", key.key.path());
            bind_failed(why, ipc::listen_is_config_error(&e))
        })?;
        listener.set_nonblocking(true).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        Ok(Some(listener))
    }

    /// What `check-config` reads beyond the configuration: the picker's
    /// certificate and key files, parsed and matched as the start would.
    pub fn check(cfg: &Config) -> Result<(), ConfigError> {
        dpcoord_gateway::tls::check(&cfg.server)
    }

    /// The daemon's in-process endpoints the fronts ask through.
    pub fn local(ready: &Ready) -> Local {
        ready.local()
    }

    /// The fronts serving, once the daemon is.
    pub fn start(ready: Ready, rt: &tokio::runtime::Handle, cfg: &Config, daemon: &Daemon) -> Result<Fronts, Failed> {
        ready.start(rt, cfg, daemon).map_err(|e| Failed::from(format!("cannot start the gateway: {e}")))
    }

    /// Each front drains for at most its second.
    pub async fn stop(fronts: Fronts) {
        fronts.stop().await
    }
}

/// Without the gateway: a configuration that turns a front on is refused.
#[cfg(not(feature = "gateway"))]
mod fronts {
    use dpcoord_daemon::config::{Config, ConfigError};
    use dpcoord_daemon::io::daemon::Daemon;
    use dpcoord_daemon::io::sockets::Local;

    use super::Failed;

    /// No front: nothing to start or stop.
    pub struct Off;

    pub fn ready(cfg: &Config) -> Result<Off, Failed> {
        match cfg.server.front() {
            Some(key) => {
                let why = format!("{key} is set, but this dpcoord was built without the gateway (feature `gateway`)");
                Err(Failed { why, code: 2 })
            }
            None => Ok(Off),
        }
    }

    /// Nothing beyond the configuration.
    pub fn check(_: &Config) -> Result<(), ConfigError> {
        Ok(())
    }

    pub fn local(_: &Off) -> Local {
        Local::default()
    }

    pub fn start(off: Off, _: &tokio::runtime::Handle, _: &Config, _: &Daemon) -> Result<Off, Failed> {
        Ok(off)
    }

    pub async fn stop(_: Off) {}
}

//! Command-line flags, built from the key specs: a key with a flag is set by
//! `--` and its name with `_` as `-` (`--dp-size` sets `engines.dp_size`).
//! A flag's value goes into the same table as the file's, so it is checked,
//! and its errors read, exactly as the file's.

use clap::{Arg, ArgAction, ArgMatches};

use super::keys::{AnyKey, Flag, Key, ALL};

/// The keys that have a flag, in `--help` order.
fn flagged() -> impl Iterator<Item = (AnyKey, &'static Key, Flag)> {
    ALL.into_iter().filter_map(|k| Some((k, k.key(), k.key().flag?)))
}

/// One argument per key with a flag (its id is the flag's name), to add to
/// the command's own.
pub fn flags() -> Vec<Arg> {
    flagged()
        .map(|(any, key, flag)| {
            let help = match flag.help {
                "" => key.path(),
                help => format!("{help} ({})", key.path()),
            };
            let long = key.flag_long().unwrap_or_default();
            let arg = Arg::new(long.clone()).long(long).value_name(flag.value_name).help(help);
            match any {
                AnyKey::Int(_) => arg.value_parser(clap::value_parser!(i64)).action(ArgAction::Set),
                AnyKey::Float(_) => arg.value_parser(clap::value_parser!(f64)).action(ArgAction::Set),
                AnyKey::Str(_) => arg.value_parser(clap::value_parser!(String)).action(ArgAction::Set),
                AnyKey::List(_) => arg.value_parser(clap::value_parser!(String)).action(ArgAction::Append),
            }
        })
        .collect()
}

/// Folds the flags given in `matches` into `root` (a flag wins over the file).
pub fn fold_flags(matches: &ArgMatches, root: &mut toml::Table) {
    for (any, key, _) in flagged() {
        let id = key.flag_long().unwrap_or_default();
        let id = id.as_str();
        let value = match any {
            AnyKey::Int(_) => matches.get_one::<i64>(id).map(|i| toml::Value::Integer(*i)),
            AnyKey::Float(_) => matches.get_one::<f64>(id).map(|x| toml::Value::Float(*x)),
            AnyKey::Str(_) => matches.get_one::<String>(id).map(|s| toml::Value::String(s.clone())),
            AnyKey::List(_) => matches
                .get_many::<String>(id)
                .map(|all| toml::Value::Array(all.cloned().map(toml::Value::String).collect())),
        };
        if let Some(value) = value {
            key.set(root, value);
        }
    }
}

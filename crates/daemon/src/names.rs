//! One name list per enum: [`names!`](crate::names!) declares a
//! field-less enum with each variant's name beside it (a wire code, a metric
//! label value, a configured name), and derives its list of all, its names
//! and, on request, its parse from that one list.

/// Declares a field-less enum whose variants each carry a name, and
/// generates from that one list:
///
/// - `ALL: [Self; N]`: every variant, in declaration order (`N` counted here);
/// - `as_str(self) -> &'static str`: the variant's name;
/// - with `#[names(parse)]` first: `parse(&str) -> Option<Self>`, the
///   variant of a name (a repeated name is then an unreachable pattern).
///
/// The generated items take the enum's visibility. Attributes and doc
/// comments, the variants' too, go through unchanged; `#[names(parse)]`,
/// when present, comes before them. Other methods go in an `impl` block of
/// their own.
///
/// ```
/// dpcoord_daemon::names! {
///     #[names(parse)]
///     /// A colour.
///     #[derive(Debug, Clone, Copy, PartialEq, Eq)]
///     pub enum Colour {
///         /// The sky's.
///         Blue => "blue",
///         Red => "red",
///     }
/// }
///
/// assert_eq!(Colour::ALL, [Colour::Blue, Colour::Red]);
/// assert_eq!(Colour::Red.as_str(), "red");
/// assert_eq!(Colour::parse("blue"), Some(Colour::Blue));
/// assert_eq!(Colour::parse("Blue"), None);
/// ```
#[macro_export]
macro_rules! names {
    (
        #[names(parse)]
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident => $str:literal),+ $(,)?
        }
    ) => {
        $crate::names! {
            $(#[$meta])*
            $vis enum $name {
                $($(#[$vmeta])* $variant => $str),+
            }
        }

        impl $name {
            /// The variant named `s`; `None` for a name no variant has.
            $vis fn parse(s: &str) -> Option<Self> {
                match s {
                    $($str => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident => $str:literal),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every variant, in declaration order.
            $vis const ALL: [Self; [$($str),+].len()] = [$(Self::$variant),+];

            /// The variant's name.
            $vis fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $str),+
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    crate::names! {
        #[names(parse)]
        /// A test enum: a doc comment, derives and variant docs go through.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        enum Parsed {
            /// The first.
            One => "one",
            TwoWords => "two_words",
            /// The last, with a trailing comma.
            Three => "three",
        }
    }

    crate::names! {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Listed {
            Only => "only"
        }
    }

    /// Names in `all` that another entry already has.
    fn repeated(all: impl IntoIterator<Item = &'static str>) -> Vec<&'static str> {
        let mut seen = HashSet::new();
        all.into_iter().filter(|n| !seen.insert(*n)).collect()
    }

    #[test]
    fn names_round_trip_and_all_lists_every_variant_once() {
        // Every variant, in order: an exhaustive match counts them.
        let index = |p: Parsed| match p {
            Parsed::One => 0,
            Parsed::TwoWords => 1,
            Parsed::Three => 2,
        };
        assert_eq!(Parsed::ALL.len(), 3);
        assert_eq!(Parsed::ALL, [Parsed::One, Parsed::TwoWords, Parsed::Three]);
        assert!(Parsed::ALL.iter().enumerate().all(|(i, p)| index(*p) == i));
        assert_eq!(Parsed::ALL.map(Parsed::as_str), ["one", "two_words", "three"]);
        for p in Parsed::ALL {
            assert_eq!(Parsed::parse(p.as_str()), Some(p), "{p:?}");
        }
        assert_eq!(Parsed::parse("One"), None);
        assert_eq!(Parsed::parse(""), None);
        assert_eq!(Parsed::ALL.iter().collect::<HashSet<_>>().len(), Parsed::ALL.len());
        assert_eq!(repeated(Parsed::ALL.map(Parsed::as_str)), Vec::<&str>::new());
        assert_eq!((Listed::ALL, Listed::Only.as_str()), ([Listed::Only], "only"));

        // The daemon's lists: no name twice in one.
        use crate::engines::{kv::Medium, StallCause, Status};
        use crate::observability::kv_metrics::{BatchResult, ReplayResult, ResetCause};
        use crate::observability::metrics::{ReloadResult, ScrapeResult, StatsResult};
        use crate::wire::{Channel, DpSizeFrom, ErrorCode, PrefixSource};
        let lists: [Vec<&'static str>; 13] = [
            StatsResult::ALL.map(StatsResult::as_str).to_vec(),
            ScrapeResult::ALL.map(ScrapeResult::as_str).to_vec(),
            ReloadResult::ALL.map(ReloadResult::as_str).to_vec(),
            BatchResult::ALL.map(BatchResult::as_str).to_vec(),
            ReplayResult::ALL.map(ReplayResult::as_str).to_vec(),
            ResetCause::ALL.map(ResetCause::as_str).to_vec(),
            Medium::ALL.map(Medium::as_str).to_vec(),
            StallCause::ALL.map(StallCause::as_str).to_vec(),
            Status::ALL.map(Status::as_str).to_vec(),
            Channel::ALL.map(Channel::as_str).to_vec(),
            ErrorCode::ALL.map(ErrorCode::as_str).to_vec(),
            DpSizeFrom::ALL.map(DpSizeFrom::as_str).to_vec(),
            PrefixSource::ALL.map(PrefixSource::as_str).to_vec(),
        ];
        for list in lists {
            assert_eq!(repeated(list.iter().copied()), Vec::<&str>::new(), "{list:?}");
            assert!(!list.is_empty());
        }
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
        }
    }
}

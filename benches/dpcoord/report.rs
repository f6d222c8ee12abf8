//! Output: aligned text tables, and the targets each part judged.

use crate::Mode;

/// One table: a title, column headers and rows of already formatted cells.
pub struct Table {
    title: String,
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// Columns left-aligned from the left (the rest are numbers, right-aligned).
    text_columns: usize,
}

impl Table {
    pub fn new(title: impl Into<String>, header: &[&str]) -> Table {
        Table {
            title: title.into(),
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            text_columns: 1,
        }
    }

    /// Left-aligns the first `n` columns.
    pub fn text_columns(mut self, n: usize) -> Table {
        self.text_columns = n;
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Prints the table: text columns left-aligned, numbers right-aligned.
    pub fn print(&self) {
        let mut width: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if i < width.len() {
                    width[i] = width[i].max(cell.chars().count());
                }
            }
        }
        let line = |cells: &[String]| {
            let parts: Vec<String> = cells
                .iter()
                .zip(&width)
                .enumerate()
                .map(|(i, (c, w))| if i < self.text_columns { format!("{c:<w$}") } else { format!("{c:>w$}") })
                .collect();
            println!("  {}", parts.join("  ").trim_end());
        };
        println!("\n{}", self.title);
        line(&self.header);
        let total: usize = width.iter().sum::<usize>() + 2 * width.len().saturating_sub(1);
        println!("  {}", "-".repeat(total));
        for row in &self.rows {
            line(row);
        }
    }
}

/// A target from issue 5 or 26 and what this run measured against it.
struct Target {
    what: String,
    goal: String,
    measured: String,
    met: bool,
}

/// Collects the targets of every part that ran.
pub struct Report {
    mode: Mode,
    targets: Vec<Target>,
}

impl Report {
    pub fn new(mode: Mode) -> Report {
        Report { mode, targets: Vec::new() }
    }

    pub fn target(&mut self, what: impl Into<String>, goal: impl Into<String>, measured: impl Into<String>, met: bool) {
        self.targets.push(Target { what: what.into(), goal: goal.into(), measured: measured.into(), met });
    }

    pub fn print_targets(&self) {
        if self.targets.is_empty() {
            return;
        }
        let mut t = Table::new("targets (issues 5 and 26)", &["target", "goal", "measured", "verdict"]).text_columns(4);
        for g in &self.targets {
            let verdict = match (self.mode, g.met) {
                (Mode::Smoke, _) => "not judged (smoke run)",
                (Mode::Full, true) => "met",
                (Mode::Full, false) => "MISSED",
            };
            t.row(vec![g.what.clone(), g.goal.clone(), g.measured.clone(), verdict.into()]);
        }
        t.print();
        if self.mode == Mode::Full {
            let missed = self.targets.iter().filter(|g| !g.met).count();
            println!("  {} of {} targets met", self.targets.len() - missed, self.targets.len());
        }
    }
}

/// Formats `x` with `digits` decimals.
pub fn num(x: f64, digits: usize) -> String {
    format!("{x:.digits$}")
}

/// Formats a rate with a thousands separator: `123,456`.
pub fn rate(x: f64) -> String {
    let n = x.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Formats a ratio `a / b` as `0.97x` (`n/a` when `b` is 0).
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "n/a".into()
    }
}

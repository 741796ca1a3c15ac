//! Figures: medians, tables printed as text and as markdown, the machine they ran on.

use std::fmt::Write as _;

/// Median of `values` (the mean of the two middle ones for an even count); NaN if empty.
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Smallest and largest, for showing the spread of rounds.
pub fn range(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// `x` with `decimals` digits, or "-" when it is not a number.
pub fn num(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "-".into()
    }
}

/// One table of the report.
pub struct Table {
    pub title: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Lines printed under the table (what was measured, how).
    pub notes: Vec<String>,
}

impl Table {
    pub fn new(title: &str, headers: &[&str]) -> Table {
        Table {
            title: title.into(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn note(&mut self, line: impl Into<String>) {
        self.notes.push(line.into());
    }

    fn widths(&self) -> Vec<usize> {
        let mut w: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if i < w.len() {
                    w[i] = w[i].max(cell.chars().count());
                }
            }
        }
        w
    }

    /// Aligned text: the first column to the left, the others to the right.
    pub fn text(&self) -> String {
        let w = self.widths();
        let mut out = format!("\n== {} ==\n", self.title);
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, cell) in cells.iter().enumerate() {
                let width = w.get(i).copied().unwrap_or(0);
                if i == 0 {
                    let _ = write!(s, "{cell:<width$}");
                } else {
                    let _ = write!(s, "  {cell:>width$}");
                }
            }
            s.push('\n');
            s
        };
        out.push_str(&line(&self.headers));
        for row in &self.rows {
            out.push_str(&line(row));
        }
        for n in &self.notes {
            let _ = writeln!(out, "  {n}");
        }
        out
    }

    pub fn markdown(&self) -> String {
        let mut out = format!("\n#### {}\n\n", self.title);
        let _ = writeln!(out, "| {} |", self.headers.join(" | "));
        let seps: Vec<&str> = self
            .headers
            .iter()
            .enumerate()
            .map(|(i, _)| if i == 0 { "---" } else { "---:" })
            .collect();
        let _ = writeln!(out, "| {} |", seps.join(" | "));
        for row in &self.rows {
            let _ = writeln!(out, "| {} |", row.join(" | "));
        }
        if !self.notes.is_empty() {
            out.push('\n');
            for n in &self.notes {
                let _ = writeln!(out, "- {n}");
            }
        }
        out
    }
}

/// The machine: kernel, CPU model, CPU count.
pub struct Machine {
    pub kernel: String,
    pub cpu: String,
    pub cpus: usize,
}

impl Machine {
    pub fn probe() -> Machine {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "?".into());
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        Machine { kernel, cpu, cpus }
    }

    pub fn line(&self) -> String {
        format!("Linux {}, {} CPU(s): {}", self.kernel, self.cpus, self.cpu)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "kernel": self.kernel, "cpu": self.cpu, "cpus": self.cpus })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}

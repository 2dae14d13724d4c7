//! A line chart of the last hour as inline SVG: no script, nothing fetched.

use std::fmt::Write;
use std::time::{Duration, Instant};

use super::history::WINDOW;
use super::http::esc;

const WIDTH: f64 = 320.0;
const HEIGHT: f64 = 90.0;
const LEFT: f64 = 44.0;
const TOP: f64 = 18.0;
const BOTTOM: f64 = 14.0;

/// A chart titled `title` of `(when, value)` points; a `None` value (the database did not
/// answer) breaks the line.
pub fn line(title: &str, unit: &str, points: &[(Instant, Option<f64>)], now: Instant) -> String {
    let top = points.iter().filter_map(|(_, v)| *v).fold(0.0f64, f64::max);
    let scale = if top > 0.0 { nice(top) } else { 1.0 };
    let plot_w = WIDTH - LEFT - 6.0;
    let plot_h = HEIGHT - TOP - BOTTOM;
    // From the first sample, at least five minutes: a server just started draws its few
    // samples across the chart, not in its last pixel.
    let window = points
        .first()
        .map_or(WINDOW, |(at, _)| now.saturating_duration_since(*at))
        .clamp(Duration::from_secs(300), WINDOW)
        .as_secs_f64();
    let x = |at: Instant| {
        let ago = now.saturating_duration_since(at).as_secs_f64().min(window);
        LEFT + plot_w * (1.0 - ago / window)
    };
    let y = |v: f64| TOP + plot_h * (1.0 - (v / scale).clamp(0.0, 1.0));
    let mut svg = format!(
        r#"<svg class="chart" role="img" aria-label="{t}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg"><title>{t}</title>"#,
        t = esc(title)
    );
    let _ = write!(
        svg,
        r##"<text x="{LEFT}" y="11" font-size="11" fill="#333">{}</text><rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/><text x="{lx}" y="{ty}" font-size="9" text-anchor="end" fill="#666">{}</text><text x="{lx}" y="{by}" font-size="9" text-anchor="end" fill="#666">0</text><text x="{LEFT}" y="{HEIGHT}" font-size="9" fill="#666">-{} min</text><text x="{rx}" y="{HEIGHT}" font-size="9" text-anchor="end" fill="#666">now</text>"##,
        esc(title),
        esc(&format!("{}{unit}", short(scale))),
        (window / 60.0).round(),
        lx = LEFT - 3.0,
        ty = TOP + 8.0,
        by = TOP + plot_h,
        rx = LEFT + plot_w,
    );
    // Runs of answered samples, each its own line.
    let mut run = String::new();
    let flush = |run: &mut String, svg: &mut String| {
        if !run.is_empty() {
            let _ = write!(
                svg,
                r##"<polyline fill="none" stroke="#1f6feb" stroke-width="1.5" points="{}"/>"##,
                run.trim_end()
            );
            run.clear();
        }
    };
    for (at, value) in points {
        match value {
            Some(v) => {
                let _ = write!(run, "{:.1},{:.1} ", x(*at), y(*v));
            }
            None => flush(&mut run, &mut svg),
        }
    }
    flush(&mut run, &mut svg);
    if points.is_empty() {
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" font-size="10" text-anchor="middle" fill="#999">no samples yet</text>"##,
            LEFT + plot_w / 2.0,
            TOP + plot_h / 2.0
        );
    }
    svg.push_str("</svg>");
    svg
}

/// The axis' top: the next 1, 2 or 5 times a power of ten at or above `v`.
fn nice(v: f64) -> f64 {
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&n| n >= v)
        .unwrap_or(10.0 * magnitude)
}

/// `v` in few characters: 950, 1.2k, 3M.
fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v >= 1e3 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.1}");
    s.strip_suffix(".0").map(str::to_owned).unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_on_round_numbers() {
        assert_eq!(nice(7.0), 10.0);
        assert_eq!(nice(120.0), 200.0);
        assert_eq!(nice(0.3), 0.5);
        assert_eq!(short(2000.0), "2k");
        assert_eq!(short(1500000.0), "1.5M");
    }

    #[test]
    fn a_gap_breaks_the_line() {
        let now = Instant::now();
        let at = |s| now - Duration::from_secs(s);
        let points = [
            (at(30), Some(1.0)),
            (at(20), Some(2.0)),
            (at(10), None),
            (at(5), Some(3.0)),
        ];
        let svg = line("backlog", "", &points, now);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
    }
}

//! Line charts as SVG through `plotters` (its SVG backend: no system fonts, no native
//! libraries; the viewer renders the text).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// One line of a chart.
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` points, in x order.
    pub points: Vec<(f64, f64)>,
    /// Drawn thin and grey, without markers (a reference such as "ideal").
    pub reference: bool,
}

/// One panel: a title, axis names, its lines, and how x values are labelled.
pub struct Chart {
    /// Caption above the panel.
    pub title: String,
    /// Name of the x axis.
    pub x_desc: String,
    /// Name of the y axis.
    pub y_desc: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Text of an x tick (e.g. sizes for a log2 axis).
    pub x_label: fn(f64) -> String,
    /// Number of x ticks.
    pub x_ticks: usize,
}

/// Writes `charts` stacked vertically into one SVG file at `path`.
pub fn svg(path: &Path, charts: &[Chart]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("plotting {}: {e}", path.display());
    let root = SVGBackend::new(path, (760, 440 * charts.len().max(1) as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    for (area, chart) in root
        .split_evenly((charts.len().max(1), 1))
        .iter()
        .zip(charts)
    {
        let points = chart.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
        for &(x, y) in points {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let pad = 0.04 * (x1 - x0);
        let y1 = if y1 > 0.0 { y1 * 1.12 } else { 1.0 };
        let mut c = ChartBuilder::on(area)
            .caption(&chart.title, ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x0 - pad..x1 + pad, 0.0..y1)
            .map_err(|e| err(&e))?;
        c.configure_mesh()
            .x_desc(chart.x_desc.as_str())
            .y_desc(chart.y_desc.as_str())
            .x_labels(chart.x_ticks)
            .x_label_formatter(&|x| (chart.x_label)(*x))
            .draw()
            .map_err(|e| err(&e))?;
        let mut colour = 0;
        for s in &chart.series {
            let style = if s.reference {
                RGBColor(150, 150, 150).stroke_width(1)
            } else {
                colour += 1;
                Palette99::pick(colour - 1).stroke_width(2)
            };
            c.draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(|e| err(&e))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            if !s.reference {
                let dots = s.points.iter().map(|&p| Circle::new(p, 3, style.filled()));
                c.draw_series(dots).map_err(|e| err(&e))?;
            }
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_svg_with_every_label() {
        let dir = std::env::temp_dir().join(format!("xtask-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.svg");
        let chart = |title: &str| Chart {
            title: title.into(),
            x_desc: "ranks".into(),
            y_desc: "samples/s".into(),
            series: vec![
                Series {
                    label: "measured".into(),
                    points: vec![(1.0, 300.0), (2.0, 580.0), (4.0, 700.0)],
                    reference: false,
                },
                Series {
                    label: "ideal".into(),
                    points: vec![(1.0, 300.0), (4.0, 1200.0)],
                    reference: true,
                },
            ],
            x_label: |x| format!("{x:.0}"),
            x_ticks: 4,
        };
        svg(&path, &[chart("first panel"), chart("second panel")]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(text.starts_with("<svg"), "{}", &text[..80.min(text.len())]);
        for label in [
            "first panel",
            "second panel",
            "measured",
            "ideal",
            "samples/s",
        ] {
            assert!(text.contains(label), "no `{label}` in the SVG");
        }
        assert!(text.contains("<polyline") || text.contains("<path"));
    }
}

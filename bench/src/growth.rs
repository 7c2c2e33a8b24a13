//! `ccm-bench --fit RUN.json,…`: growth with cluster size, from the reports of runs at several
//! sizes (one command per size writes each): memory, CPU per unit of work and join time
//! against the Nodes, each fitted, checked for growth worse than linear, projected to larger
//! clusters under stated assumptions, and plotted (an SVG the benchmark writes beside the
//! JSON).
//!
//! - Memory is fitted as `a + b·Nodes + c·Services` (least squares): `b` and `c` are the
//!   bytes each Node and each Service costs. With the sizes' Services all equal, `c` cannot be
//!   told from `a` and the fit is `a + b·Nodes`.
//! - CPU per unit of work should not grow with the cluster: the fit's slope per 1000 Nodes
//!   and the largest size's value against the smallest's say whether it does.
//! - Join time is bound by the API server budget (2 writes per Node at `--kube-api-qps`): its
//!   ratio to that floor is the figure that should stay flat.
//! - "Worse than linear": the largest size against the linear fit of the smaller ones (more
//!   than 15% above is flagged).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Serialize;

/// One size's figures, from its report.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub file: String,
    pub nodes: f64,
    pub services: f64,
    pub kube_api_qps: f64,
    pub rss_steady_mib: f64,
    pub rss_peak_mib: f64,
    pub cpu_ms_per_node_initialised: f64,
    pub cpu_ms_per_load_balancer_made: f64,
    pub cpu_ms_per_route_created: f64,
    pub cpu_ms_per_load_balancer_update: f64,
    pub join_seconds: f64,
    pub join_floor_seconds: f64,
    pub steady_cloud_calls_per_hour: f64,
}

/// A straight line through points, and how well it fits.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Line {
    pub intercept: f64,
    /// Per Node.
    pub slope: f64,
    /// Per Service (memory only; 0 when the sizes' Services do not vary).
    pub per_service: f64,
    /// The largest size's value over what the fit of the smaller sizes predicts for it (NaN:
    /// too few sizes to tell).
    pub largest_over_smaller_fit: f64,
}

/// A projection to a larger cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Projection {
    pub nodes: f64,
    pub services: f64,
    pub rss_steady_mib: f64,
    pub rss_peak_mib: f64,
    /// The join floor at the assumed API budget, times the largest measured ratio to it.
    pub join_seconds: f64,
    pub join_floor_seconds: f64,
    /// The address refresh: a BatchInstanceMetadata per 500 Nodes every 5 minutes.
    pub steady_cloud_calls_per_hour: f64,
}

/// The fit of every series, and the projections.
#[derive(Debug, Clone, Serialize)]
pub struct Growth {
    pub core: String,
    pub points: Vec<Point>,
    pub rss_steady: Line,
    pub rss_peak: Line,
    pub cpu_per_node_initialised: Line,
    pub cpu_per_load_balancer_update: Line,
    pub join_seconds: Line,
    /// Join time over its floor, per size.
    pub join_over_floor: Vec<f64>,
    /// What grows worse than linearly (empty: nothing).
    pub worse_than_linear: Vec<String>,
    /// The assumptions of the projections.
    pub assumptions: Vec<String>,
    pub projections: Vec<Projection>,
}

fn number(v: &serde_json::Value, path: &[&str]) -> f64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_f64().unwrap_or(f64::NAN)
}

fn point(path: &Path, core: Option<&str>) -> anyhow::Result<(String, Point)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let report: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let cores =
        report["cores"].as_object().with_context(|| format!("{}: not a report of ccm-bench's sim runs", path.display()))?;
    let name = match core {
        Some(c) => c.to_string(),
        None => ["rust-musl", "rust"]
            .iter()
            .find(|c| cores.contains_key(**c))
            .map(|c| c.to_string())
            .with_context(|| format!("{}: no rust or rust-musl core", path.display()))?,
    };
    let f = cores.get(&name).with_context(|| format!("{}: no core {name}", path.display()))?;
    Ok((
        name,
        Point {
            file: path.display().to_string(),
            nodes: number(&report, &["nodes"]),
            services: number(&report, &["services"]),
            kube_api_qps: number(&report, &["kube_api_qps"]),
            rss_steady_mib: number(f, &["rss_steady_mib"]),
            rss_peak_mib: number(f, &["rss_peak_mib"]),
            cpu_ms_per_node_initialised: number(f, &["per_unit", "node_initialised"]),
            cpu_ms_per_load_balancer_made: number(f, &["per_unit", "load_balancer_made"]),
            cpu_ms_per_route_created: number(f, &["per_unit", "route_created"]),
            cpu_ms_per_load_balancer_update: number(f, &["per_unit", "load_balancer_update"]),
            join_seconds: number(f, &["join_seconds"]),
            join_floor_seconds: number(&report, &["floors", "join_seconds"]),
            steady_cloud_calls_per_hour: number(f, &["steady_cloud_calls_per_hour"]),
        },
    ))
}

/// Least squares of `y` on the columns of `x` (each row: the regressors, a 1 included).
fn least_squares(x: &[Vec<f64>], y: &[f64]) -> Option<Vec<f64>> {
    let k = x.first()?.len();
    // The normal equations, solved by Gaussian elimination with partial pivoting.
    let mut a = vec![vec![0.0; k + 1]; k];
    for (row, yi) in x.iter().zip(y) {
        for i in 0..k {
            for j in 0..k {
                a[i][j] += row[i] * row[j];
            }
            a[i][k] += row[i] * yi;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|p, q| a[*p][col].abs().total_cmp(&a[*q][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (_, row) in a.iter_mut().enumerate().filter(|(r, _)| *r != col) {
            let factor = row[col] / pivot_row[col];
            for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                *x -= factor * p;
            }
        }
    }
    Some((0..k).map(|i| a[i][k] / a[i][i]).collect())
}

/// `y = a + b·nodes (+ c·services)`, and the largest size against the fit of the others.
fn fit(points: &[Point], y: impl Fn(&Point) -> f64, with_services: bool) -> Line {
    let usable: Vec<&Point> = points.iter().filter(|p| y(p).is_finite()).collect();
    // Services as a second regressor only with the points to tell it apart: two Service
    // counts or more, and more sizes than unknowns.
    let vary = with_services && usable.len() > 3 && usable.iter().any(|p| p.services != usable[0].services);
    let row = |p: &Point| if vary { vec![1.0, p.nodes, p.services] } else { vec![1.0, p.nodes] };
    let solve = |ps: &[&Point]| {
        let x: Vec<Vec<f64>> = ps.iter().map(|p| row(p)).collect();
        let ys: Vec<f64> = ps.iter().map(|p| y(p)).collect();
        least_squares(&x, &ys)
    };
    let mut line = Line { largest_over_smaller_fit: f64::NAN, ..Default::default() };
    if let Some(c) = solve(&usable) {
        line.intercept = c[0];
        line.slope = c[1];
        line.per_service = c.get(2).copied().unwrap_or(0.0);
    }
    // The largest size against the line of the others (when they are enough to draw one).
    let need = if vary { 3 } else { 2 };
    if usable.len() > need
        && let Some((largest, smaller)) = usable.split_last()
        && let Some(c) = solve(smaller)
    {
        let predicted: f64 = row(largest).iter().zip(&c).map(|(x, c)| x * c).sum();
        line.largest_over_smaller_fit = y(largest) / predicted;
    }
    line
}

/// Fits the reports of `files` (each one size).
pub fn fit_files(files: &[PathBuf], core: Option<&str>, assumed_qps: f64) -> anyhow::Result<Growth> {
    let mut points = Vec::new();
    let mut core_name = String::new();
    for f in files {
        let (name, p) = point(f, core)?;
        core_name = name;
        points.push(p);
    }
    points.sort_by(|a, b| a.nodes.total_cmp(&b.nodes));
    if points.len() < 2 {
        bail!("--fit needs the reports of two sizes at least");
    }
    let rss_steady = fit(&points, |p| p.rss_steady_mib, true);
    let rss_peak = fit(&points, |p| p.rss_peak_mib, true);
    let cpu_per_node_initialised = fit(&points, |p| p.cpu_ms_per_node_initialised, false);
    let cpu_per_load_balancer_update = fit(&points, |p| p.cpu_ms_per_load_balancer_update, false);
    let join_seconds = fit(&points, |p| p.join_seconds, false);
    let join_over_floor: Vec<f64> = points.iter().map(|p| p.join_seconds / p.join_floor_seconds).collect();
    let mut worse = Vec::new();
    for (what, line) in [("steady memory", &rss_steady), ("peak memory", &rss_peak), ("join time", &join_seconds)] {
        if line.largest_over_smaller_fit > 1.15 {
            worse.push(format!(
                "{what}: the largest size is {:.2}x what the smaller sizes' line predicts",
                line.largest_over_smaller_fit
            ));
        }
    }
    let (first, last) = (&points[0], &points[points.len() - 1]);
    // A Node initialised and a route created are the same work at any size: the largest
    // size's cost is held to the cheapest smaller size's (the smallest one carries the
    // start's fixed costs, and comparing with it alone hid a per-Node cost growing with the
    // Nodes). A load balancer update carries every Node, so its cost may grow with them.
    let cheapest = |f: fn(&Point) -> f64| {
        points[..points.len() - 1].iter().map(|p| (f(p), p.nodes)).filter(|(v, _)| *v > 0.0).min_by(|a, b| a.0.total_cmp(&b.0))
    };
    for (what, f) in [
        ("CPU per Node initialised", (|p: &Point| p.cpu_ms_per_node_initialised) as fn(&Point) -> f64),
        ("CPU per route created", |p: &Point| p.cpu_ms_per_route_created),
    ] {
        if let Some((a, at)) = cheapest(f)
            && f(last) > 1.25 * a
        {
            worse.push(format!("{what}: {:.2} ms at {} Nodes against {a:.2} ms at {at} Nodes", f(last), last.nodes));
        }
    }
    let (a, b) = (first.cpu_ms_per_load_balancer_update, last.cpu_ms_per_load_balancer_update);
    if b > 1.5 * a {
        worse.push(format!(
            "CPU per load balancer update: {b:.2} ms at {} Nodes against {a:.2} ms at {} Nodes",
            last.nodes, first.nodes
        ));
    }
    let ratio = join_over_floor.iter().copied().filter(|r| r.is_finite()).fold(f64::NAN, f64::max);
    let services = last.services;
    let assumptions = vec![
        format!("{services} Services, as the largest run"),
        format!(
            "join: 2 API writes per Node at --kube-api-qps {assumed_qps} (the floor), times the largest measured ratio to the floor ({ratio:.2})"
        ),
        "steady cloud calls: the address refresh only (a BatchInstanceMetadata per 500 Nodes every 5 minutes); \
         load balancers and routes make none"
            .to_string(),
        "memory: the fitted line; nothing in the core keeps more than a slimmed copy per Node and Service".to_string(),
    ];
    let projections = [65_000.0, 100_000.0]
        .into_iter()
        .map(|nodes: f64| {
            let memory = |l: &Line| l.intercept + l.slope * nodes + l.per_service * services;
            let floor = 2.0 * nodes / assumed_qps;
            Projection {
                nodes,
                services,
                rss_steady_mib: memory(&rss_steady),
                rss_peak_mib: memory(&rss_peak),
                join_seconds: floor * ratio,
                join_floor_seconds: floor,
                steady_cloud_calls_per_hour: (nodes / 500.0).ceil() * 12.0,
            }
        })
        .collect();
    Ok(Growth {
        core: core_name,
        points,
        rss_steady,
        rss_peak,
        cpu_per_node_initialised,
        cpu_per_load_balancer_update,
        join_seconds,
        join_over_floor,
        worse_than_linear: worse,
        assumptions,
        projections,
    })
}

impl Growth {
    /// The table.
    pub fn table(&self) -> String {
        let mut t = format!("growth with cluster size ({} core)\n", self.core);
        t += &format!(
            "{:>8} {:>8} {:>12} {:>12} {:>14} {:>14} {:>14} {:>14} {:>10} {:>10} {:>8}\n",
            "Nodes",
            "Services",
            "RSS steady",
            "RSS peak",
            "ms/Node init",
            "ms/LB made",
            "ms/route",
            "ms/LB update",
            "join (s)",
            "floor (s)",
            "ratio"
        );
        for (p, r) in self.points.iter().zip(&self.join_over_floor) {
            t += &format!(
                "{:>8} {:>8} {:>12.1} {:>12.1} {:>14.2} {:>14.2} {:>14.2} {:>14.2} {:>10.1} {:>10.1} {:>7.2}x\n",
                p.nodes,
                p.services,
                p.rss_steady_mib,
                p.rss_peak_mib,
                p.cpu_ms_per_node_initialised,
                p.cpu_ms_per_load_balancer_made,
                p.cpu_ms_per_route_created,
                p.cpu_ms_per_load_balancer_update,
                p.join_seconds,
                p.join_floor_seconds,
                r
            );
        }
        let kib = |mib: f64| mib * 1024.0;
        t += &format!(
            "fitted: steady memory {:.1} MiB + {:.2} KiB per Node + {:.2} KiB per Service (largest size {} the smaller ones' line)\n",
            self.rss_steady.intercept,
            kib(self.rss_steady.slope),
            kib(self.rss_steady.per_service),
            times(self.rss_steady.largest_over_smaller_fit)
        );
        t += &format!(
            "fitted: peak memory {:.1} MiB + {:.2} KiB per Node + {:.2} KiB per Service (largest size {})\n",
            self.rss_peak.intercept,
            kib(self.rss_peak.slope),
            kib(self.rss_peak.per_service),
            times(self.rss_peak.largest_over_smaller_fit)
        );
        t += &format!(
            "fitted: CPU per Node initialised {:.3} ms {:+.4} ms per 1000 Nodes; per load balancer update {:.3} ms {:+.4} ms per 1000 Nodes\n",
            self.cpu_per_node_initialised.intercept,
            self.cpu_per_node_initialised.slope * 1000.0,
            self.cpu_per_load_balancer_update.intercept,
            self.cpu_per_load_balancer_update.slope * 1000.0
        );
        t += &format!(
            "fitted: join {:.1} s + {:.2} ms per Node (largest size {} the smaller ones' line)\n",
            self.join_seconds.intercept,
            self.join_seconds.slope * 1000.0,
            times(self.join_seconds.largest_over_smaller_fit)
        );
        if self.worse_than_linear.is_empty() {
            t += "nothing grows worse than linearly\n";
        }
        for w in &self.worse_than_linear {
            t += &format!("WORSE THAN LINEAR: {w}\n");
        }
        t += "projected:\n";
        for p in &self.projections {
            t += &format!(
                "  {:>7} Nodes, {} Services: RSS {:.0} MiB steady, {:.0} MiB peak; join {:.0} s (floor {:.0} s); {:.0} cloud calls/hour at steady state\n",
                p.nodes,
                p.services,
                p.rss_steady_mib,
                p.rss_peak_mib,
                p.join_seconds,
                p.join_floor_seconds,
                p.steady_cloud_calls_per_hour
            );
        }
        t += "assuming:\n";
        for a in &self.assumptions {
            t += &format!("  - {a}\n");
        }
        t
    }

    /// Three panels (memory, CPU per unit of work, join time against its floor) over the
    /// Nodes, measured points, fitted lines, projections.
    pub fn svg(&self) -> String {
        let mut panels = Vec::new();
        let memory_line = |l: Line, services: f64| move |n: f64| l.intercept + l.slope * n + l.per_service * services;
        let services = self.points.last().map_or(0.0, |p| p.services);
        panels.push(Panel {
            title: "resident memory (MiB)",
            series: vec![
                Series {
                    name: "steady",
                    color: "#1f77b4",
                    points: self.points.iter().map(|p| (p.nodes, p.rss_steady_mib)).collect(),
                    projected: self.projections.iter().map(|p| (p.nodes, p.rss_steady_mib)).collect(),
                    line: Some(Box::new(memory_line(self.rss_steady, services))),
                },
                Series {
                    name: "peak",
                    color: "#d62728",
                    points: self.points.iter().map(|p| (p.nodes, p.rss_peak_mib)).collect(),
                    projected: self.projections.iter().map(|p| (p.nodes, p.rss_peak_mib)).collect(),
                    line: Some(Box::new(memory_line(self.rss_peak, services))),
                },
            ],
        });
        let cpu = |name: &'static str, color: &'static str, f: fn(&Point) -> f64| Series {
            name,
            color,
            points: self.points.iter().map(|p| (p.nodes, f(p))).collect(),
            projected: Vec::new(),
            line: None,
        };
        panels.push(Panel {
            title: "CPU ms per unit of work",
            series: vec![
                cpu("per Node initialised", "#1f77b4", |p| p.cpu_ms_per_node_initialised),
                cpu("per load balancer made", "#ff7f0e", |p| p.cpu_ms_per_load_balancer_made),
                cpu("per route created", "#2ca02c", |p| p.cpu_ms_per_route_created),
                cpu("per load balancer update", "#d62728", |p| p.cpu_ms_per_load_balancer_update),
            ],
        });
        panels.push(Panel {
            title: "join: all Nodes initialised (s)",
            series: vec![
                Series {
                    name: "measured",
                    color: "#1f77b4",
                    points: self.points.iter().map(|p| (p.nodes, p.join_seconds)).collect(),
                    projected: self.projections.iter().map(|p| (p.nodes, p.join_seconds)).collect(),
                    line: None,
                },
                Series {
                    name: "floor (API budget)",
                    color: "#7f7f7f",
                    points: self.points.iter().map(|p| (p.nodes, p.join_floor_seconds)).collect(),
                    projected: self.projections.iter().map(|p| (p.nodes, p.join_floor_seconds)).collect(),
                    line: None,
                },
            ],
        });
        render(&panels, &format!("ccm-rs core ({}): growth with the Nodes", self.core))
    }
}

struct Series {
    name: &'static str,
    color: &'static str,
    points: Vec<(f64, f64)>,
    projected: Vec<(f64, f64)>,
    line: Option<Box<dyn Fn(f64) -> f64>>,
}

struct Panel {
    title: &'static str,
    series: Vec<Series>,
}

/// A plain SVG: one chart per panel, side by side; x the Nodes from 0 (to the largest point,
/// projections included), y from 0.
fn render(panels: &[Panel], title: &str) -> String {
    let (w, h, left, top, bottom, right) = (420.0, 320.0, 60.0, 40.0, 50.0, 20.0);
    let width = w * panels.len() as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"16\" font-size=\"14\">{}</text>\n",
        h + 30.0,
        escape(title)
    );
    for (i, panel) in panels.iter().enumerate() {
        let x0 = w * i as f64;
        let max_x = panel.series.iter().flat_map(|s| s.points.iter().chain(&s.projected).map(|p| p.0)).fold(1.0, f64::max)
            * if panel.series.iter().all(|s| s.projected.is_empty()) { 1.1 } else { 1.0 };
        let max_y = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().chain(&s.projected).map(|p| p.1))
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max)
            .max(1e-9)
            * 1.1;
        let px = |x: f64| x0 + left + (x / max_x) * (w - left - right);
        let py = |y: f64| 30.0 + top + (1.0 - y / max_y) * (h - top - bottom);
        out += &format!(
            "<g><text x=\"{}\" y=\"{}\" font-size=\"12\">{}</text>\n",
            x0 + left,
            30.0 + top - 12.0,
            escape(panel.title)
        );
        out += &format!(
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
            px(0.0),
            py(0.0),
            px(max_x),
            py(0.0),
            px(0.0),
            py(0.0),
            px(0.0),
            py(max_y)
        );
        for k in 0..=4 {
            let (xv, yv) = (max_x * f64::from(k) / 4.0, max_y * f64::from(k) / 4.0);
            out += &format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}k</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
                px(xv),
                py(0.0) + 14.0,
                if max_x < 10_000.0 { format!("{:.1}", xv / 1000.0) } else { format!("{:.0}", xv / 1000.0) },
                px(0.0) - 4.0,
                py(yv) + 4.0,
                short(yv)
            );
        }
        out += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">Nodes</text>\n", px(max_x / 2.0), py(0.0) + 30.0);
        for (j, s) in panel.series.iter().enumerate() {
            if let Some(line) = &s.line {
                let pts: Vec<String> =
                    (0..=50).map(|k| max_x * f64::from(k) / 50.0).map(|x| format!("{:.1},{:.1}", px(x), py(line(x)))).collect();
                out += &format!(
                    "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-dasharray=\"4 3\"/>\n",
                    pts.join(" "),
                    s.color
                );
            } else if s.points.len() > 1 {
                let pts: Vec<String> = s.points.iter().map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y))).collect();
                out += &format!("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\"/>\n", pts.join(" "), s.color);
            }
            for (x, y) in s.points.iter().filter(|p| p.1.is_finite()) {
                out += &format!("<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{}\"/>\n", px(*x), py(*y), s.color);
            }
            for (x, y) in s.projected.iter().filter(|p| p.1.is_finite()) {
                out += &format!(
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"white\" stroke=\"{}\"/>\n",
                    px(*x),
                    py(*y),
                    s.color
                );
            }
            out += &format!(
                "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>\n",
                px(0.0) + 10.0,
                30.0 + top + 4.0 + 14.0 * j as f64,
                s.color,
                px(0.0) + 24.0,
                30.0 + top + 13.0 + 14.0 * j as f64,
                escape(s.name)
            );
        }
        out += "</g>\n";
    }
    out += &format!(
        "<text x=\"10\" y=\"{}\" fill=\"#555\">filled: measured; open: projected; dashed: fitted line</text>\n</svg>\n",
        h + 22.0
    );
    out
}

/// "1.04x", or "-" when not known.
fn times(v: f64) -> String {
    if v.is_finite() { format!("{v:.2}x") } else { "-".into() }
}

fn short(v: f64) -> String {
    if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(nodes: f64, services: f64, rss: f64, cpu: f64, join: f64) -> Point {
        Point {
            file: String::new(),
            nodes,
            services,
            kube_api_qps: 200.0,
            rss_steady_mib: rss,
            rss_peak_mib: rss * 1.1,
            cpu_ms_per_node_initialised: cpu,
            cpu_ms_per_load_balancer_made: 1.0,
            cpu_ms_per_route_created: 1.0,
            cpu_ms_per_load_balancer_update: 0.1,
            join_seconds: join,
            join_floor_seconds: 2.0 * nodes / 200.0,
            steady_cloud_calls_per_hour: 0.0,
        }
    }

    #[test]
    fn a_linear_cost_is_found_and_not_flagged_and_a_quadratic_one_is() {
        // 20 MiB + 4 KiB per Node + 8 KiB per Service.
        let rss = |n: f64, s: f64| 20.0 + n * 4.0 / 1024.0 + s * 8.0 / 1024.0;
        let points: Vec<Point> = [(1000.0, 200.0), (5000.0, 5000.0), (10_000.0, 5000.0), (20_000.0, 5000.0)]
            .iter()
            .map(|(n, s)| p(*n, *s, rss(*n, *s), 1.0, 2.0 * n / 200.0 * 1.05))
            .collect();
        let line = fit(&points, |p| p.rss_steady_mib, true);
        assert!((line.slope * 1024.0 - 4.0).abs() < 1e-6, "{line:?}");
        assert!((line.per_service * 1024.0 - 8.0).abs() < 1e-6, "{line:?}");
        assert!((line.largest_over_smaller_fit - 1.0).abs() < 1e-6);
        let quadratic: Vec<Point> =
            points.iter().map(|q| p(q.nodes, q.services, 20.0 + (q.nodes / 1000.0).powi(2), 1.0, 1.0)).collect();
        assert!(fit(&quadratic, |p| p.rss_steady_mib, true).largest_over_smaller_fit > 1.15);
    }

    #[test]
    fn a_cost_per_node_initialised_that_grows_with_the_nodes_is_flagged() {
        let dir = tempfile::tempdir().expect("dir");
        let fit_of = |per_node: [f64; 4]| {
            let mut files = Vec::new();
            for ((n, s), cpu) in [(1000, 200), (5000, 5000), (10_000, 5000), (20_000, 5000)].into_iter().zip(per_node) {
                let report = serde_json::json!({
                    "nodes": n, "services": s, "kube_api_qps": 200.0,
                    "floors": { "join_seconds": 2.0 * f64::from(n) / 200.0 },
                    "cores": { "rust": {
                        "rss_steady_mib": 30.0 + f64::from(n) / 256.0, "rss_peak_mib": 35.0 + f64::from(n) / 256.0,
                        "per_unit": { "node_initialised": cpu, "load_balancer_made": 3.0, "route_created": 0.15, "load_balancer_update": 0.1 },
                        "join_seconds": 2.0 * f64::from(n) / 200.0 * 1.02, "steady_cloud_calls_per_hour": 24.0
                    } }
                });
                let path = dir.path().join(format!("{n}.json"));
                std::fs::write(&path, report.to_string()).expect("write");
                files.push(path);
            }
            fit_files(&files, None, 200.0).expect("fit").worse_than_linear
        };
        // The figures of 2026-12-06 before the route reconciles stopped following joins.
        let grows = fit_of([1.12, 0.93, 1.21, 1.66]);
        assert!(grows.iter().any(|w| w.contains("CPU per Node initialised")), "{grows:?}");
        // Flat but for the smallest size's fixed costs, and noise.
        let flat = fit_of([1.12, 0.93, 0.98, 1.05]);
        assert!(flat.is_empty(), "{flat:?}");
    }

    #[test]
    fn the_reports_fit_project_and_plot() {
        let dir = tempfile::tempdir().expect("dir");
        let mut files = Vec::new();
        for (n, s) in [(1000, 200), (5000, 5000), (20_000, 5000)] {
            let report = serde_json::json!({
                "nodes": n, "services": s, "kube_api_qps": 200.0,
                "floors": { "join_seconds": 2.0 * f64::from(n) / 200.0 },
                "cores": { "rust": {
                    "rss_steady_mib": 30.0 + f64::from(n) / 256.0, "rss_peak_mib": 35.0 + f64::from(n) / 256.0,
                    "per_unit": { "node_initialised": 1.2, "load_balancer_made": 3.0, "route_created": 0.3, "load_balancer_update": 0.1 },
                    "join_seconds": 2.0 * f64::from(n) / 200.0 * 1.04, "steady_cloud_calls_per_hour": 24.0
                } }
            });
            let path = dir.path().join(format!("{n}.json"));
            std::fs::write(&path, report.to_string()).expect("write");
            files.push(path);
        }
        let growth = fit_files(&files, None, 200.0).expect("fit");
        assert_eq!(growth.core, "rust");
        assert!(growth.worse_than_linear.is_empty(), "{:?}", growth.worse_than_linear);
        let at_100k = &growth.projections[1];
        assert!((at_100k.rss_steady_mib - (30.0 + 100_000.0 / 256.0)).abs() < 1.0, "{at_100k:?}");
        assert!((at_100k.join_floor_seconds - 1000.0).abs() < 1e-9);
        assert_eq!(at_100k.steady_cloud_calls_per_hour, 2400.0);
        let svg = growth.svg();
        assert!(svg.starts_with("<svg") && svg.contains("resident memory") && svg.matches("<circle").count() >= 3 * 6);
        assert!(growth.table().contains("nothing grows worse than linearly"));
    }
}

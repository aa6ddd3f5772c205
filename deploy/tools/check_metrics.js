#!/usr/bin/env node
// Cross-checks the metric names used by Strata's Prometheus rules and Grafana dashboard against
// the metric catalogue (docs/metrics.md).
//
//   node check_metrics.js --catalog docs/metrics.md --dashboard strata.json \
//        [--k8s RENDERED.yaml]... [--emit-dashboard-rules OUT.yml] RULES.yml...
//   node check_metrics.js --catalog docs/metrics.md --exposition SCRAPE.txt [--process NAME]
//
// Fails (exit 1, one line per problem) when:
//  - the catalogue table is malformed (name, type, labels columns) or lists a name twice;
//  - a rule file or the dashboard does not parse, or the dashboard lacks title/uid/panels,
//    has duplicate panel ids, panels outside the 24-column grid or overlapping, or a target
//    without an expression;
//  - a PromQL expression names a strata_* series that is not in the catalogue (histograms also
//    give <name>_bucket, _sum, _count) or a strata:* series no recording rule defines;
//  - a label matcher on a strata_* series uses a label the catalogue does not list for it (target
//    labels such as namespace, pod, job and instance are always allowed), or a value outside the
//    label's closed set;
//  - rate()/irate()/increase() is applied to a gauge, or a counter is used without one;
//  - the recording rules in the catalogue's "Derived series" table and the rule files differ.
// --k8s adds the Prometheus queries of the KEDA ScaledObjects in rendered manifests to the
// dashboard's expressions (same checks, also emitted below).
// --emit-dashboard-rules writes every dashboard expression as a recording rule (Grafana
// variables replaced by constants) so that `promtool check rules` can check their syntax.
// --exposition checks a scrape of a running process (`curl -s http://ADDR/metrics > SCRAPE.txt`,
// Prometheus text format) against the catalogue: every strata_* family is catalogued with the
// same type, its samples carry only catalogued labels with values from the closed sets; with
// --process coordinator|worker|kvstore|serve, every metric the catalogue says that process
// exports must be present (serve: all of them).
// Exit status: 0 all good, 1 problems, 2 usage or I/O error.
'use strict';

const fs = require('fs');
const YAML = require('yaml');

function usage(msg) {
  if (msg) console.error(`check_metrics: ${msg}`);
  console.error('usage: check_metrics.js --catalog FILE.md --dashboard FILE.json [--emit-dashboard-rules OUT] RULES.yml...');
  console.error('       check_metrics.js --catalog FILE.md --exposition SCRAPE.txt [--process coordinator|worker|kvstore|serve]');
  process.exit(2);
}
const argv = process.argv.slice(2);
let catalogPath; let dashboardPath; let emitPath; let expositionPath; let processName;
const rulePaths = [];
const k8sPaths = [];
for (let i = 0; i < argv.length; i++) {
  if (argv[i] === '--catalog') catalogPath = argv[++i];
  else if (argv[i] === '--exposition') expositionPath = argv[++i];
  else if (argv[i] === '--process') processName = argv[++i];
  else if (argv[i] === '--k8s') k8sPaths.push(argv[++i]);
  else if (argv[i] === '--dashboard') dashboardPath = argv[++i];
  else if (argv[i] === '--emit-dashboard-rules') emitPath = argv[++i];
  else if (argv[i].startsWith('--')) usage(`unknown flag ${argv[i]}`);
  else rulePaths.push(argv[i]);
}
if (!catalogPath) usage('--catalog is required');
if (!expositionPath && (!dashboardPath || rulePaths.length === 0)) usage('missing arguments');
if (expositionPath && (dashboardPath || rulePaths.length)) usage('--exposition is a mode of its own');
if (processName && !['coordinator', 'worker', 'kvstore', 'serve'].includes(processName)) usage(`unknown process ${processName}`);
function read(p) {
  try { return fs.readFileSync(p, 'utf8'); } catch (e) { usage(`cannot read ${p}: ${e.message}`); }
  return '';
}

const problems = [];
const problem = (where, msg) => problems.push(`${where}: ${msg}`);

// Labels every scraped series may carry (added by Prometheus, the ServiceMonitor or the local
// scrape config), besides its own.
const TARGET_LABELS = new Set(['namespace', 'pod', 'instance', 'job', 'service', 'container',
  'endpoint', 'component', 'deployment', '__name__']);

// ---------------------------------------------------------------------------------------------
// The catalogue.
const catalog = new Map();  // name -> {type, labels:Set, processes:Set}
const labelValues = new Map();  // label -> Set of values
const documentedRules = new Set();
{
  const text = read(catalogPath);
  let section = '';
  for (const line of text.split('\n')) {
    if (line.startsWith('## ')) section = line.slice(3).trim();
    if (!line.startsWith('|')) continue;
    const cells = line.split('|').slice(1, -1).map((c) => c.trim());
    if (section === 'The metrics' && /^`strata_/.test(cells[0])) {
      const name = cells[0].replace(/`/g, '');
      const type = cells[1];
      if (!/^strata_[a-z0-9_]+$/.test(name)) problem(catalogPath, `bad metric name ${cells[0]}`);
      if (!['counter', 'gauge', 'histogram'].includes(type)) problem(catalogPath, `${name}: unknown type ${type}`);
      if (type === 'counter' && !name.endsWith('_total')) problem(catalogPath, `${name}: counters end in _total`);
      if (type !== 'counter' && name.endsWith('_total')) problem(catalogPath, `${name}: only counters end in _total`);
      if (catalog.has(name)) problem(catalogPath, `${name} listed twice`);
      const labels = new Set((cells[2] || '').split(',').map((l) => l.replace(/`/g, '').trim())
        .filter((l) => /^[a-z_]+$/.test(l)));
      const processes = new Set((cells[4] || '').match(/\b(coordinator|worker|kvstore)\b/g) || []);
      if (processes.size === 0) problem(catalogPath, `${name}: the "exported by" column names no process`);
      catalog.set(name, { type, labels, processes });
    } else if (section === 'Label values' && /^`[a-z_]+`$/.test(cells[0])) {
      const label = cells[0].replace(/`/g, '');
      const values = [...(cells[1] || '').matchAll(/`([a-z_]+)`/g)].map((m) => m[1]);
      if (values.length) labelValues.set(label, new Set(values));  // else an open (bounded) set
    } else if (section.startsWith('Derived series')) {
      for (const m of (cells[0] || '').matchAll(/`(strata:[a-z0-9_:]+)`/g)) documentedRules.add(m[1]);
    }
  }
  if (catalog.size === 0) problem(catalogPath, 'no metrics found in the "The metrics" table');
}

// Resolves a strata_* series name to its catalogue entry (histograms give _bucket/_sum/_count).
function lookup(series) {
  if (catalog.has(series)) return { base: series, ...catalog.get(series), part: '' };
  const m = /^(.*)_(bucket|sum|count)$/.exec(series);
  if (m && catalog.has(m[1]) && catalog.get(m[1]).type === 'histogram') {
    const e = catalog.get(m[1]);
    const labels = new Set(e.labels);
    if (m[2] === 'bucket') labels.add('le');
    return { base: m[1], type: e.type, labels, part: m[2] };
  }
  return null;
}

// ---------------------------------------------------------------------------------------------
// PromQL scanning (names, matchers and rate() arguments; not a full parser — promtool parses).
function stripStrings(expr) {
  return expr.replace(/"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`/g, (s) => ' '.repeat(s.length));
}
const recordedLabels = new Map();  // recording rule -> Set of labels it keeps

function checkExpr(where, expr) {
  const bare = stripStrings(expr);
  const re = /(^|[^A-Za-z0-9_:$])(strata[_:][A-Za-z0-9_:]*)/g;
  let m;
  let found = 0;
  while ((m = re.exec(bare)) !== null) {
    const name = m[2];
    const start = m.index + m[1].length;
    const end = start + name.length;
    found++;
    let allowed;
    if (name.startsWith('strata:')) {
      if (!recordedLabels.has(name)) { problem(where, `${name} is not defined by any recording rule`); continue; }
      allowed = recordedLabels.get(name);
    } else {
      const e = lookup(name);
      if (!e) { problem(where, `${name} is not in ${catalogPath}`); continue; }
      allowed = e.labels;
      // Counters (and histogram series) only make sense through rate/increase; gauges never.
      const before = bare.slice(0, start).replace(/\s+$/, '');
      const inRate = /(?:^|[^A-Za-z0-9_])(rate|irate|increase)\($/.test(before);
      const counterLike = e.type === 'counter' || e.part !== '';
      if (inRate && !counterLike) problem(where, `${name} is a gauge: rate()/increase() does not apply`);
      const inAbsent = /(?:^|[^A-Za-z0-9_])absent\($/.test(before);
      if (!inRate && !inAbsent && counterLike) {
        problem(where, `${name} is a ${e.part ? 'histogram series' : 'counter'}: use it through rate() or increase()`);
      }
    }
    // Label matchers directly after the name.
    if (bare[end] === '{') {
      const close = bare.indexOf('}', end);
      const matchers = expr.slice(end + 1, close);
      for (const mm of matchers.matchAll(/([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"/g)) {
        const [, label, op, value] = mm;
        if (!allowed.has(label) && !TARGET_LABELS.has(label)) {
          problem(where, `${name} has no label ${label}`);
        } else if (op === '=' && labelValues.has(label) && allowed.has(label) && !labelValues.get(label).has(value)) {
          problem(where, `${name}{${label}="${value}"}: ${value} is not a ${label} value (${[...labelValues.get(label)].join(', ')})`);
        }
      }
    }
  }
  // by/without clauses may only name labels that exist somewhere in the catalogue.
  for (const g of bare.matchAll(/\b(?:by|without)\s*\(([^)]*)\)/g)) {
    for (const l of g[1].split(',').map((s) => s.trim()).filter(Boolean)) {
      const known = TARGET_LABELS.has(l) || l === 'le' || [...catalog.values()].some((e) => e.labels.has(l));
      if (!known) problem(where, `grouping by unknown label ${l}`);
    }
  }
  return found;
}

// ---------------------------------------------------------------------------------------------
// Exposition mode: a scrape of a running process.
function checkExposition() {
  const where = expositionPath;
  const types = new Map();
  const seen = new Set();
  let n = 0;
  for (const line of read(expositionPath).split('\n')) {
    n++;
    const t = /^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (\w+)\s*$/.exec(line);
    if (t) {
      types.set(t[1], t[2]);
      if (!t[1].startsWith('strata_')) continue;
      const e = catalog.get(t[1]);
      if (!e) problem(`${where}:${n}`, `family ${t[1]} is not in ${catalogPath}`);
      else if (e.type !== t[2]) problem(`${where}:${n}`, `${t[1]} is a ${t[2]}, the catalogue says ${e.type}`);
      seen.add(t[1]);
      continue;
    }
    if (/^\s*(#|$)/.test(line)) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+(\s+\S+)?\s*$/.exec(line);
    if (!m) { problem(`${where}:${n}`, 'not a sample line'); continue; }
    if (!m[1].startsWith('strata_')) continue;
    const e = lookup(m[1]);
    if (!e) { problem(`${where}:${n}`, `${m[1]} is not in ${catalogPath}`); continue; }
    seen.add(e.base);
    for (const lm of (m[2] || '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      const [, label, value] = lm;
      if (!e.labels.has(label)) problem(`${where}:${n}`, `${m[1]} has no label ${label} in the catalogue`);
      else if (labelValues.has(label) && !labelValues.get(label).has(value)) {
        problem(`${where}:${n}`, `${m[1]}{${label}="${value}"}: not a ${label} value (${[...labelValues.get(label)].join(', ')})`);
      }
    }
  }
  if (processName) {
    for (const [name, e] of catalog) {
      if ((processName === 'serve' || e.processes.has(processName)) && !seen.has(name)) {
        problem(where, `${name} (exported by ${[...e.processes].join(', ')}) is missing`);
      }
    }
  }
  return seen.size;
}
if (expositionPath) {
  const families = checkExposition();
  if (problems.length) {
    for (const p of problems) console.error(`FAIL ${p}`);
    console.error(`check_metrics: ${problems.length} problem(s)`);
    process.exit(1);
  }
  console.log(`check_metrics: ${families} strata families in ${expositionPath} match the catalogue${processName ? ` (all of ${processName}'s present)` : ''}`);
  process.exit(0);
}

// ---------------------------------------------------------------------------------------------
// Rule files: first collect the recording rules (and the labels they keep), then check all.
const ruleExprs = [];  // {where, expr}
for (const p of rulePaths) {
  const doc = YAML.parseDocument(read(p), { uniqueKeys: true });
  if (doc.errors.length) { problem(p, `YAML: ${doc.errors[0].message.split('\n')[0]}`); continue; }
  const y = doc.toJS();
  if (!y || !Array.isArray(y.groups)) { problem(p, 'no groups'); continue; }
  for (const g of y.groups) {
    for (const r of g.rules || []) {
      const id = r.record || r.alert;
      if (typeof r.expr !== 'string') { problem(`${p} ${id}`, 'expr missing'); continue; }
      if (r.record) {
        const labels = new Set();
        for (const b of stripStrings(r.expr).matchAll(/\bby\s*\(([^)]*)\)/g)) {
          b[1].split(',').map((s) => s.trim()).filter((l) => l && l !== 'le').forEach((l) => labels.add(l));
        }
        if (recordedLabels.has(r.record)) problem(p, `recording rule ${r.record} defined twice`);
        recordedLabels.set(r.record, labels);
      }
      ruleExprs.push({ where: `${p} ${r.record ? 'record' : 'alert'} ${id}`, expr: r.expr });
    }
  }
}
for (const { where, expr } of ruleExprs) {
  if (checkExpr(where, expr) === 0) problem(where, 'names no strata metric');
}
for (const r of documentedRules) if (!recordedLabels.has(r)) problem(catalogPath, `documents ${r}, which no rule file defines`);
for (const r of recordedLabels.keys()) if (!documentedRules.has(r)) problem(catalogPath, `does not document the recording rule ${r}`);

// ---------------------------------------------------------------------------------------------
// The dashboard.
const dashExprs = [];
{
  let dash;
  try {
    dash = JSON.parse(read(dashboardPath));
  } catch (e) {
    problem(dashboardPath, `JSON: ${e.message}`);
  }
  if (dash) {
    for (const k of ['title', 'uid', 'panels', 'schemaVersion']) if (!(k in dash)) problem(dashboardPath, `missing ${k}`);
    const ids = new Set();
    const cells = new Map();  // "x,y" grid cell -> panel id
    // Panels inside a collapsed row keep the positions they have when it is expanded, so they are
    // not checked for overlap.
    const walk = (panels, nested) => {
      for (const p of panels || []) {
        const where = `${dashboardPath} panel ${p.id} "${p.title}"`;
        if (typeof p.id !== 'number' || ids.has(p.id)) problem(where, 'panel id missing or duplicated');
        ids.add(p.id);
        const gp = p.gridPos || {};
        if (![gp.h, gp.w, gp.x, gp.y].every(Number.isInteger) || gp.x < 0 || gp.w < 1 || gp.x + gp.w > 24) {
          problem(where, 'bad gridPos');
        } else if (!nested) {
          for (let x = gp.x; x < gp.x + gp.w; x++) {
            for (let y = gp.y; y < gp.y + gp.h; y++) {
              const other = cells.get(`${x},${y}`);
              if (other !== undefined) { problem(where, `overlaps panel ${other}`); x = Infinity; break; }
              cells.set(`${x},${y}`, p.id);
            }
          }
        }
        if (p.type !== 'row' && !(p.targets || []).length) problem(where, 'no targets');
        for (const t of p.targets || []) {
          if (typeof t.expr !== 'string' || !t.expr.trim()) { problem(where, `target ${t.refId} has no expr`); continue; }
          dashExprs.push({ where: `${where} ${t.refId}`, expr: t.expr });
        }
        walk(p.panels, true);
      }
    };
    walk(dash.panels, false);
    for (const v of ((dash.templating || {}).list || [])) {
      const q = typeof v.query === 'string' ? v.query : (v.query && v.query.query);
      const lv = /^label_values\((.*),\s*([a-z_]+)\)$/.exec(q || '');
      if (v.type === 'query' && lv) dashExprs.push({ where: `${dashboardPath} variable ${v.name}`, expr: lv[1] + ' > -1' });
    }
  }
}
// KEDA ScaledObject queries in rendered manifests (--k8s): the autoscaler reads catalogued names.
for (const p of k8sPaths) {
  for (const doc of YAML.parseAllDocuments(read(p))) {
    if (doc.errors.length) { problem(p, `YAML: ${doc.errors[0].message.split('\n')[0]}`); break; }
    const o = doc.toJS();
    if (!o || o.kind !== 'ScaledObject') continue;
    for (const [i, t] of ((o.spec || {}).triggers || []).entries()) {
      if (t.type === 'prometheus' && t.metadata && typeof t.metadata.query === 'string') {
        dashExprs.push({ where: `${p} ScaledObject ${o.metadata.name} trigger ${i}`, expr: t.metadata.query });
      }
    }
  }
}
for (const { where, expr } of dashExprs) {
  if (checkExpr(where, expr) === 0) problem(where, 'names no strata metric');
}
if (emitPath) {
  const rules = dashExprs.map((d, i) => ({
    record: `dashboard:expr_${i}`,
    expr: d.expr.replace(/\$__rate_interval|\$__interval|\$__range/g, '5m').replace(/\$\{?[A-Za-z_]+\}?/g, '.*'),
  }));
  fs.writeFileSync(emitPath, YAML.stringify({ groups: [{ name: 'dashboard', rules }] }));
}

if (problems.length) {
  for (const p of problems) console.error(`FAIL ${p}`);
  console.error(`check_metrics: ${problems.length} problem(s)`);
  process.exit(1);
}
console.log(`check_metrics: ${catalog.size} catalogued metrics; ${ruleExprs.length} rule and ${dashExprs.length} dashboard/autoscaler expressions use only catalogued names`);

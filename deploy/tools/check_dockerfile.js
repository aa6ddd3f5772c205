#!/usr/bin/env node
// Static checks of a multi-stage Dockerfile, without Docker (none runs on the build machines):
// stage names unique; every `COPY --from=X` / `FROM X` names an earlier stage or an image;
// every local COPY/ADD source and every repository script a RUN line calls exists (scripts
// executable); ARGs used in FROM are declared before the first FROM; the targets named on the
// command line exist. Usage: check_dockerfile.js DOCKERFILE REPO_ROOT [TARGET...]
// Exit status: 0 good, 1 problems, 2 usage or I/O error.
'use strict';
const fs = require('fs');
const path = require('path');

const [dockerfile, root, ...targets] = process.argv.slice(2);
if (!dockerfile || !root) {
  console.error('usage: check_dockerfile.js DOCKERFILE REPO_ROOT [TARGET...]');
  process.exit(2);
}
let text;
try { text = fs.readFileSync(dockerfile, 'utf8'); } catch (e) { console.error(e.message); process.exit(2); }

// Join continuation lines, drop comments and blank lines.
const lines = [];
let cur = '';
let lineNo = 0; let startNo = 0;
for (const raw of text.split('\n')) {
  lineNo++;
  if (!cur && /^\s*(#|$)/.test(raw)) continue;
  if (!cur) startNo = lineNo;
  if (/\\\s*$/.test(raw)) { cur += raw.replace(/\\\s*$/, ' '); continue; }
  cur += raw;
  lines.push({ no: startNo, text: cur.trim() });
  cur = '';
}
const problems = [];
const problem = (no, msg) => problems.push(`${dockerfile}:${no}: ${msg}`);
const KNOWN = new Set(['FROM', 'RUN', 'CMD', 'LABEL', 'EXPOSE', 'ENV', 'ADD', 'COPY', 'ENTRYPOINT',
  'VOLUME', 'USER', 'WORKDIR', 'ARG', 'ONBUILD', 'STOPSIGNAL', 'HEALTHCHECK', 'SHELL']);
const stages = [];
const globalArgs = new Set();
let sawFrom = false;
for (const { no, text: l } of lines) {
  const [instr, ...rest] = l.split(/\s+/);
  const op = instr.toUpperCase();
  if (!KNOWN.has(op)) { problem(no, `unknown instruction ${instr}`); continue; }
  if (op === 'ARG' && !sawFrom) globalArgs.add(rest[0].split('=')[0]);
  if (op === 'FROM') {
    sawFrom = true;
    const image = rest.filter((r) => !r.startsWith('--'))[0] || '';
    for (const m of image.matchAll(/\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?/g)) {
      if (!globalArgs.has(m[1])) problem(no, `FROM uses ARG ${m[1]}, not declared before the first FROM`);
    }
    const as = rest.findIndex((r) => r.toUpperCase() === 'AS');
    if (as >= 0) {
      const name = rest[as + 1];
      if (stages.includes(name)) problem(no, `stage ${name} defined twice`);
      stages.push(name);
    }
  }
  if (op === 'COPY' || op === 'ADD') {
    const from = rest.find((r) => r.startsWith('--from='));
    const args = rest.filter((r) => !r.startsWith('--'));
    if (args.length < 2) { problem(no, `${op} needs a source and a destination`); continue; }
    if (from) {
      const s = from.slice('--from='.length);
      if (!stages.includes(s) && !s.includes(':') && !s.includes('/')) problem(no, `--from=${s} names no earlier stage`);
      continue;
    }
    for (const src of args.slice(0, -1)) {
      if (/^(https?:)?\$\{?[A-Za-z_]/.test(src) || /^https?:\/\//.test(src) || src === '.') continue;
      if (!fs.existsSync(path.join(root, src))) problem(no, `${op} source ${src} does not exist in ${root}`);
    }
  }
  if (op === 'RUN') {
    for (const m of l.matchAll(/(?:^|[\s;&|])((?:scripts|deploy)\/[A-Za-z0-9_./-]+\.sh)\b/g)) {
      const p = path.join(root, m[1]);
      if (!fs.existsSync(p)) problem(no, `RUN calls ${m[1]}, which does not exist`);
      else if (!(fs.statSync(p).mode & 0o111)) problem(no, `RUN calls ${m[1]}, which is not executable`);
    }
  }
}
for (const t of targets) if (!stages.includes(t)) problems.push(`${dockerfile}: target ${t} is not a stage`);
if (problems.length) {
  for (const p of problems) console.error(`FAIL ${p}`);
  process.exit(1);
}
console.log(`check_dockerfile: ${stages.length} stages OK (${stages.join(', ')})`);

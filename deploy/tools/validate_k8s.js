#!/usr/bin/env node
// Offline validation of rendered Kubernetes manifests (the output of `kustomize build`).
//
//   node validate_k8s.js [--policy] [--summary-json OUT] FILE.yaml...
//
// Three layers, each of which fails the run (exit 1) with one line per problem:
//  1. schema: every object is validated against the OpenAPI-derived JSON schemas bundled in
//     npm `kubernetes-models` (core and apps/policy/...), `@kubernetes-models/prometheus-operator`
//     (ServiceMonitor) and `@kubernetes-models/keda` (ScaledObject). An apiVersion/kind without a
//     model is an error, never a skip.
//  2. strict fields: the same models' TypeScript declarations are used to type-check every object
//     as an object literal, so unknown fields (a typo such as `readinesProbe`) and wrong types are
//     errors. The JSON schemas alone do not reject unknown fields.
//  3. --policy: Strata's own rules across the objects of each file (one file = one rendered
//     overlay): selectors that match, probe ports, grace periods consistent with preStop + drain,
//     GPU and host-tier memory, scrape annotations, KEDA target and query namespace.
// --summary-json OUT writes {"FILE": number of problems} (used by the self-test of
// scripts/check_deploy.sh to check many broken copies in one run).
// Exit status: 0 all good, 1 problems found, 2 usage or I/O error.
'use strict';

const fs = require('fs');
const path = require('path');
const YAML = require('yaml');

function usage(msg) {
  if (msg) console.error(`validate_k8s: ${msg}`);
  console.error('usage: validate_k8s.js [--policy] [--summary-json OUT] FILE.yaml...');
  process.exit(2);
}

const args = process.argv.slice(2);
let policy = false;
let summaryPath;
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--policy') policy = true;
  else if (args[i] === '--summary-json') summaryPath = args[++i];
  else if (args[i].startsWith('--')) usage(`unknown flag ${args[i]}`);
  else files.push(args[i]);
}
if (files.length === 0) usage('no input files');

const problems = [];
const perFile = Object.fromEntries(files.map((f) => [f, 0]));
let currentFile = files[0];  // the file the problems being reported belong to
function problem(where, msg) {
  problems.push(`${where}: ${msg}`);
  perFile[currentFile]++;
}

// ---------------------------------------------------------------------------------------------
// Parse.
const objects = [];  // {obj, where}
for (const file of files) {
  let text;
  try {
    text = fs.readFileSync(file, 'utf8');
  } catch (e) {
    usage(`cannot read ${file}: ${e.message}`);
  }
  currentFile = file;
  const docs = YAML.parseAllDocuments(text, { uniqueKeys: true, strict: true });
  docs.forEach((doc, i) => {
    const where0 = `${file}#${i}`;
    if (doc.errors.length) {
      doc.errors.forEach((e) => problem(where0, `YAML: ${e.message.split('\n')[0]}`));
      return;
    }
    const obj = doc.toJS();
    if (obj === null || obj === undefined) return;  // empty document
    if (typeof obj !== 'object' || Array.isArray(obj)) {
      problem(where0, 'not a Kubernetes object (a mapping is expected)');
      return;
    }
    const name = obj.metadata && obj.metadata.name;
    const ns = obj.metadata && obj.metadata.namespace;
    objects.push({ obj, file, where: `${path.basename(file)}: ${obj.kind}/${ns ? ns + '/' : ''}${name}` });
  });
}

// ---------------------------------------------------------------------------------------------
// 1. Schema validation with the published models.
function modelModule(apiVersion, kind) {
  if (typeof apiVersion !== 'string' || typeof kind !== 'string' || !/^[A-Z][A-Za-z0-9]*$/.test(kind)) {
    return null;
  }
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  if (group === 'monitoring.coreos.com') {
    return `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`;
  }
  if (group === 'keda.sh') return `@kubernetes-models/keda/${group}/${version}/${kind}`;
  if (group === '') return `kubernetes-models/${version}/${kind}`;
  return `kubernetes-models/${group}/${version}/${kind}`;
}

const typed = [];  // {obj, where, file, module, kind} for the strict pass
for (const { obj, where, file } of objects) {
  currentFile = file;
  if (!obj.apiVersion || !obj.kind) {
    problem(where, 'apiVersion and kind are required');
    continue;
  }
  if (!obj.metadata || typeof obj.metadata.name !== 'string' || obj.metadata.name === '') {
    problem(where, 'metadata.name is required');
  }
  const mod = modelModule(obj.apiVersion, obj.kind);
  let Model;
  try {
    Model = mod && require(mod)[obj.kind];
  } catch (e) {
    Model = undefined;
  }
  if (!Model) {
    problem(where, `no schema for ${obj.apiVersion} ${obj.kind} (not a known API)`);
    continue;
  }
  try {
    new Model(obj).validate();
  } catch (e) {
    const details = (e.errors || []).map((x) => `${x.instancePath || '/'} ${x.message}`);
    problem(where, `schema: ${details.length ? details.join('; ') : e.message}`);
  }
  typed.push({ obj, where, file, module: mod, kind: obj.kind });
}

// ---------------------------------------------------------------------------------------------
// 2. Strict fields: type-check each object literal against the model's TypeScript interface.
function strictCheck() {
  if (typed.length === 0) return;
  const ts = require('typescript');
  const toolsDir = __dirname;
  const virtualFile = path.join(toolsDir, '__validate_k8s_check__.ts');
  const lines = [];
  const ranges = [];  // [firstLine, lastLine, where]
  typed.forEach((t, i) => {
    lines.push(`import type { I${t.kind} as T${i} } from ${JSON.stringify(t.module)};`);
  });
  typed.forEach((t, i) => {
    const first = lines.length;
    const body = JSON.stringify(t.obj, null, 1).split('\n');
    body[0] = `export const o${i}: T${i} = ${body[0]}`;
    body[body.length - 1] += ';';
    lines.push(...body);
    ranges.push([first, lines.length - 1, t.where, t.file]);
  });
  const source = lines.join('\n');
  const options = {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    types: [],
    target: ts.ScriptTarget.ES2020,
    module: ts.ModuleKind.Node16,
    moduleResolution: ts.ModuleResolutionKind.Node16,
  };
  const host = ts.createCompilerHost(options);
  const origGetSourceFile = host.getSourceFile.bind(host);
  const origFileExists = host.fileExists.bind(host);
  const origReadFile = host.readFile.bind(host);
  host.getSourceFile = (f, lang, onError, create) =>
    (path.resolve(f) === virtualFile ? ts.createSourceFile(f, source, lang, true)
                                     : origGetSourceFile(f, lang, onError, create));
  host.fileExists = (f) => path.resolve(f) === virtualFile || origFileExists(f);
  host.readFile = (f) => (path.resolve(f) === virtualFile ? source : origReadFile(f));
  const program = ts.createProgram([virtualFile], options, host);
  const diags = ts.getPreEmitDiagnostics(program);
  for (const d of diags) {
    const msg = ts.flattenDiagnosticMessageText(d.messageText, ' ');
    if (!d.file || path.resolve(d.file.fileName) !== virtualFile) {
      problem('strict', `TypeScript: ${msg}`);
      continue;
    }
    const { line } = d.file.getLineAndCharacterOfPosition(d.start);
    const r = ranges.find(([a, b]) => line >= a && line <= b);
    if (r) currentFile = r[3];
    // Point at the field: the text of the offending line of the generated literal.
    const text = lines[line] ? lines[line].trim() : '';
    problem(r ? r[2] : 'strict', `strict: ${msg}${text ? ` (at ${text})` : ''}`);
  }
}
strictCheck();

// ---------------------------------------------------------------------------------------------
// 3. Strata's cross-object policy.
const GiB = 1024 ** 3;
function parseQuantity(q) {
  if (typeof q === 'number') return q;
  const m = /^([0-9.]+)([KMGTPE]i?|m)?$/.exec(String(q));
  if (!m) return NaN;
  const n = parseFloat(m[1]);
  const mult = {
    undefined: 1, m: 1e-3, K: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18,
    Ki: 1024, Mi: 1024 ** 2, Gi: GiB, Ti: 1024 ** 4, Pi: 1024 ** 5, Ei: 1024 ** 6,
  }[m[2]];
  return n * mult;
}
function matches(selector, labels) {
  if (!selector || typeof selector !== 'object') return false;
  const ml = selector.matchLabels || {};
  if (Object.keys(ml).length === 0 && !(selector.matchExpressions || []).length) return false;
  if (!Object.entries(ml).every(([k, v]) => labels && labels[k] === v)) return false;
  return (selector.matchExpressions || []).every((e) => {
    const has = labels && Object.prototype.hasOwnProperty.call(labels, e.key);
    if (e.operator === 'In') return has && e.values.includes(labels[e.key]);
    if (e.operator === 'NotIn') return !has || !e.values.includes(labels[e.key]);
    if (e.operator === 'Exists') return has;
    if (e.operator === 'DoesNotExist') return !has;
    return false;
  });
}
// Expands $(VAR) from the container's env, as the kubelet does for args: literal values, and a
// placeholder for values the kubelet fills in (fieldRef, e.g. the pod IP).
function expandArgs(c) {
  const env = {};
  for (const e of c.env || []) {
    if (typeof e.value === 'string') env[e.name] = e.value;
    else if (e.valueFrom && e.valueFrom.fieldRef) env[e.name] = `fieldRef(${e.valueFrom.fieldRef.fieldPath})`;
  }
  return (c.args || []).map((a) => String(a).replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g,
    (m, v) => (v in env ? env[v] : m)));
}
function flag(argv, name) {
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === name) return i + 1 < argv.length ? argv[i + 1] : '';
    if (argv[i].startsWith(name + '=')) return argv[i].slice(name.length + 1);
  }
  return undefined;
}
function portOf(addr) {
  const m = /:(\d+)$/.exec(addr || '');
  return m ? Number(m[1]) : undefined;
}

// The processes (DESIGN.md section 1) and the flags each requires.
const REQUIRED_FLAGS = {
  coordinator: ['--listen', '--metrics-listen', '--data'],
  worker: ['--listen', '--metrics-listen', '--coordinator', '--kvstore', '--model'],
  kvstore: ['--listen', '--data', '--metrics-listen'],
};
// The flags each process accepts (an unknown flag makes `strata` exit 2: a crash loop), from
// cli/coordinator_command.cc, cli/worker_command.cc and cli/kvstore_command.cc. Keep in sync.
const KNOWN_FLAGS = {
  coordinator: ['--listen', '--metrics-listen', '--data', '--port-file', '--model-namespace',
    '--vocab-size', '--num-layers', '--page-size', '--target-shard-tokens', '--max-document-tokens',
    '--max-upload-mib', '--max-prompt-tokens', '--max-tokens-limit', '--max-pending-jobs',
    '--max-pending-tokens', '--heartbeat-interval-ms', '--heartbeat-timeout-ms',
    '--drain-timeout-seconds', '--sync', '--no-sync'],
  worker: ['--listen', '--metrics-listen', '--coordinator', '--kvstore', '--model', '--worker-id',
    '--advertise', '--selection-link-listen', '--port-file', '--page-size', '--prefill-chunk', '--max-jobs',
    '--capacity-tokens', '--threads', '--drain-timeout-seconds', '--host-cache-bytes'],
  kvstore: ['--listen', '--data', '--metrics-listen', '--port-file', '--gc-interval-seconds',
    '--max-message-mib', '--threads', '--sync', '--no-sync'],
};

// Runs on the objects of one rendered file (one overlay): references never cross files.
function runPolicy(objects, file) {
  const byKind = (k) => objects.filter((o) => o.obj.kind === k);
  const nsOf = (o) => (o.obj.metadata && o.obj.metadata.namespace) || '';
  const workloads = [...byKind('Deployment'), ...byKind('StatefulSet')];
  const services = byKind('Service');
  const pvcs = new Set(byKind('PersistentVolumeClaim').map((o) => `${nsOf(o)}/${o.obj.metadata.name}`));
  const podLabels = (w) => (((w.obj.spec || {}).template || {}).metadata || {}).labels || {};
  const podSpec = (w) => ((w.obj.spec || {}).template || {}).spec || {};

  if (workloads.length === 0) problem(file, 'no Deployment or StatefulSet rendered');
  const components = new Set();
  const workerSettings = [];  // {w, maxJobs, pageSize}
  const coordinatorPageSizes = [];

  for (const w of workloads) {
    const spec = w.obj.spec || {};
    const ps = podSpec(w);
    if (!matches(spec.selector, podLabels(w))) problem(w.where, 'spec.selector does not match the pod template labels');
    const grace = ps.terminationGracePeriodSeconds;
    if (typeof grace !== 'number') problem(w.where, 'terminationGracePeriodSeconds must be set explicitly');
    const ann = ((spec.template || {}).metadata || {}).annotations || {};
    if (ann['prometheus.io/scrape'] !== 'true') problem(w.where, 'pod annotation prometheus.io/scrape: "true" missing');
    const claimVolumes = new Set([
      ...(ps.volumes || []).filter((v) => v.persistentVolumeClaim).map((v) => v.name),
      ...((spec.volumeClaimTemplates || []).map((t) => t.metadata && t.metadata.name)),
    ]);
    for (const v of ps.volumes || []) {
      if (v.persistentVolumeClaim && !pvcs.has(`${nsOf(w)}/${v.persistentVolumeClaim.claimName}`)) {
        problem(w.where, `volume ${v.name} claims ${v.persistentVolumeClaim.claimName}, which is not rendered`);
      }
    }
    for (const c of ps.containers || []) {
      const where = `${w.where} container ${c.name}`;
      const argv = expandArgs(c);
      const unresolved = argv.find((a) => /\$\([A-Za-z_]/.test(a));
      if (unresolved) problem(where, `argument ${unresolved} refers to an env var with no literal value`);
      const component = argv[0];
      if (!REQUIRED_FLAGS[component]) {
        problem(where, `first argument must be a strata process (${Object.keys(REQUIRED_FLAGS).join('|')}), got ${component}`);
        continue;
      }
      components.add(component);
      for (const f of REQUIRED_FLAGS[component]) {
        if (!flag(argv, f)) problem(where, `${component} requires ${f}`);
      }
      for (const arg of argv.slice(1)) {
        const name = arg.split('=')[0];
        if (arg.startsWith('--') && !KNOWN_FLAGS[component].includes(name)) {
          problem(where, `${component} has no flag ${name}`);
        }
      }
      const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
      if (!ports.grpc || !ports.metrics) problem(where, 'container ports named grpc and metrics are required');
      if (portOf(flag(argv, '--listen')) !== ports.grpc) problem(where, '--listen port differs from the grpc container port');
      if (portOf(flag(argv, '--metrics-listen')) !== ports.metrics) problem(where, '--metrics-listen port differs from the metrics container port');
      if (String(ann['prometheus.io/port']) !== String(ports.metrics)) problem(where, 'prometheus.io/port annotation differs from the metrics port');
      for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
        const p = c[probe];
        if (!p || !p.grpc) problem(where, `${probe} must be a native grpc probe (grpc.health.v1)`);
        else if (p.grpc.port !== ports.grpc) problem(where, `${probe} probes port ${p.grpc.port}, not the grpc port ${ports.grpc}`);
      }
      // Graceful shutdown: preStop sleep, then SIGTERM and the drain, all inside the grace period.
      const pre = ((c.lifecycle || {}).preStop || {}).exec;
      const sleep = pre && Array.isArray(pre.command) && /(^|\/)sleep$/.test(pre.command[0]) ? Number(pre.command[1]) : NaN;
      if (!(sleep > 0)) problem(where, 'lifecycle.preStop must be an exec sleep (load balancers stop routing first)');
      const drain = Number(flag(argv, '--drain-timeout-seconds') || 0);
      if (Number.isNaN(drain)) problem(where, '--drain-timeout-seconds is not a number');
      if (typeof grace === 'number' && sleep > 0 && !(grace >= sleep + drain + 10)) {
        problem(where, `terminationGracePeriodSeconds ${grace} < preStop ${sleep} s + drain ${drain} s + 10 s`);
      }
      // --data must live on a persistent volume (restart-safe catalog / page store).
      const data = flag(argv, '--data');
      if (data) {
        const mount = (c.volumeMounts || []).find((m) => data === m.mountPath || data.startsWith(m.mountPath.replace(/\/$/, '') + '/'));
        if (!mount || !claimVolumes.has(mount.name)) problem(where, `--data ${data} is not on a PersistentVolumeClaim`);
      }
      if (component === 'coordinator') coordinatorPageSizes.push(Number(flag(argv, '--page-size') || 64));
      const res = c.resources || {};
      const req = res.requests || {};
      const lim = res.limits || {};
      if (!req.cpu || !req.memory || !lim.memory) problem(where, 'requests.cpu, requests.memory and limits.memory are required');
      if (component === 'worker') {
        if (String(lim['nvidia.com/gpu']) !== '1') problem(where, 'a worker needs exactly one GPU: limits nvidia.com/gpu: 1');
        if (parseQuantity(req.memory) !== parseQuantity(lim.memory)) problem(where, 'worker memory request must equal its limit (pinned host tier)');
        const cache = Number(flag(argv, '--host-cache-bytes') || 0);
        const shm = (ps.volumes || []).filter((v) => v.emptyDir && v.emptyDir.medium === 'Memory')
          .reduce((s, v) => s + parseQuantity(v.emptyDir.sizeLimit || 0), 0);
        const need = cache + shm + 4 * GiB;
        if (parseQuantity(lim.memory) < need) {
          problem(where, `limits.memory ${lim.memory} < host cache ${(cache / GiB).toFixed(1)} GiB + shm ${(shm / GiB).toFixed(1)} GiB + 4 GiB`);
        }
        // A worker registers an address the coordinator and its peers dial.
        const listenHost = (flag(argv, '--listen') || '').replace(/:\d+$/, '');
        const adv = flag(argv, '--advertise');
        if (['0.0.0.0', '[::]', ''].includes(listenHost) && !adv) {
          problem(where, 'a worker listening on all interfaces needs --advertise (e.g. $(POD_IP):port)');
        }
        if (adv && portOf(adv) !== ports.grpc) problem(where, `--advertise ${adv} is not on the grpc port ${ports.grpc}`);
        workerSettings.push({ w, maxJobs: Number(flag(argv, '--max-jobs') || 4), pageSize: Number(flag(argv, '--page-size') || 64) });
        for (const f of ['--coordinator', '--kvstore']) {
          const addr = flag(argv, f) || '';
          const host = addr.replace(/:\d+$/, '').split('.')[0];
          const svc = services.find((s) => s.obj.metadata.name === host && nsOf(s) === nsOf(w));
          if (!svc) problem(where, `${f} ${addr} names no rendered Service`);
          else if (!(svc.obj.spec.ports || []).some((p) => p.port === portOf(addr))) problem(where, `${f} ${addr}: Service ${host} has no port ${portOf(addr)}`);
        }
      }
    }
  }
  for (const need of Object.keys(REQUIRED_FLAGS)) {
    if (!components.has(need)) problem(file, `no ${need} workload rendered`);
  }
  for (const s of services) {
    const targets = workloads.filter((w) => nsOf(w) === nsOf(s) && matches({ matchLabels: s.obj.spec.selector }, podLabels(w)));
    if (targets.length === 0) { problem(s.where, 'selector matches no workload'); continue; }
    for (const p of s.obj.spec.ports || []) {
      if (typeof p.targetPort !== 'string') continue;
      for (const t of targets) {
        if (!(podSpec(t).containers || []).some((c) => (c.ports || []).some((cp) => cp.name === p.targetPort))) {
          problem(s.where, `targetPort ${p.targetPort} is not a container port of ${t.obj.metadata.name}`);
        }
      }
    }
  }
  for (const sts of byKind('StatefulSet')) {
    const svc = services.find((s) => s.obj.metadata.name === sts.obj.spec.serviceName && nsOf(s) === nsOf(sts));
    if (!svc) problem(sts.where, `serviceName ${sts.obj.spec.serviceName} names no rendered Service`);
    else if (svc.obj.spec.clusterIP !== 'None') problem(sts.where, `Service ${svc.obj.metadata.name} must be headless`);
    if (!(sts.obj.spec.volumeClaimTemplates || []).length) problem(sts.where, 'volumeClaimTemplates required (durable pages)');
  }
  for (const pdb of byKind('PodDisruptionBudget')) {
    if (!workloads.some((w) => nsOf(w) === nsOf(pdb) && matches(pdb.obj.spec.selector, podLabels(w)))) {
      problem(pdb.where, 'selector matches no workload');
    }
  }
  for (const w of workloads) {
    if (podLabels(w)['app.kubernetes.io/component'] === 'coordinator') continue;  // README: no budget
    if (!byKind('PodDisruptionBudget').some((p) => nsOf(p) === nsOf(w) && matches(p.obj.spec.selector, podLabels(w)))) {
      problem(w.where, 'no PodDisruptionBudget covers this workload');
    }
  }
  for (const sm of byKind('ServiceMonitor')) {
    const eps = (sm.obj.spec.endpoints || []).map((e) => e.port);
    const hit = services.filter((s) => nsOf(s) === nsOf(sm) && matches(sm.obj.spec.selector, s.obj.metadata.labels || {}));
    if (hit.length === 0) problem(sm.where, 'selector matches no Service');
    for (const s of hit) {
      if (!eps.some((e) => (s.obj.spec.ports || []).some((p) => p.name === e))) problem(sm.where, `Service ${s.obj.metadata.name} has none of the endpoint ports ${eps.join(',')}`);
    }
  }
  for (const so of byKind('ScaledObject')) {
    const ref = so.obj.spec.scaleTargetRef || {};
    const kind = ref.kind || 'Deployment';
    if (!workloads.some((w) => w.obj.kind === kind && w.obj.metadata.name === ref.name && nsOf(w) === nsOf(so))) {
      problem(so.where, `scaleTargetRef ${kind}/${ref.name} is not rendered`);
    }
    for (const t of so.obj.spec.triggers || []) {
      const q = (t.metadata || {}).query || '';
      if (t.type === 'prometheus' && !q.includes('strata_job_queue_length')) problem(so.where, 'the prometheus trigger must use strata_job_queue_length');
      for (const m of q.matchAll(/namespace="([^"]*)"/g)) {
        if (nsOf(so) && m[1] !== nsOf(so)) problem(so.where, `query selects namespace="${m[1]}" but the object is in ${nsOf(so)}`);
      }
    }
    if (!(so.obj.spec.minReplicaCount <= so.obj.spec.maxReplicaCount)) problem(so.where, 'minReplicaCount > maxReplicaCount');
    // desired = ceil(jobs / threshold): a threshold above --max-jobs under-provisions.
    const target = workerSettings.find((x) => x.w.obj.metadata.name === ref.name && nsOf(x.w) === nsOf(so));
    for (const t of so.obj.spec.triggers || []) {
      const th = Number((t.metadata || {}).threshold);
      if (target && th > target.maxJobs) problem(so.where, `threshold ${th} jobs per worker > the worker's --max-jobs ${target.maxJobs}`);
    }
  }
  for (const x of workerSettings) {
    for (const ps of coordinatorPageSizes) {
      if (ps !== x.pageSize) problem(x.w.where, `--page-size ${x.pageSize} differs from the coordinator's ${ps}`);
    }
  }
}
if (policy) {
  for (const file of files) {
    currentFile = file;
    runPolicy(objects.filter((o) => o.file === file), file);
  }
}
if (summaryPath) fs.writeFileSync(summaryPath, JSON.stringify(perFile, null, 1));

if (problems.length) {
  for (const p of problems) console.error(`FAIL ${p}`);
  console.error(`validate_k8s: ${problems.length} problem(s) in ${objects.length} object(s)`);
  process.exit(1);
}
console.log(`validate_k8s: ${objects.length} object(s) OK (schema, strict fields${policy ? ', policy' : ''})`);

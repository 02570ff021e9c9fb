// Regenerate ecs-<ver>-flat.json from the @elastic/ecs npm tarball:
//   npm pack @elastic/ecs@9.4.0 && tar xzf elastic-ecs-9.4.0.tgz && node make_ecs_flat.js package 9.4.0
const [dir, ver] = process.argv.slice(2);
const x = require(require("path").resolve(dir, "generated/ecs_flat.js")).EcsFlat;
const fields = {};
for (const k of Object.keys(x).sort()) { const f = x[k]; const row = [f.type]; if ((f.normalize || []).includes("array")) row.push("array"); fields[k] = row; }
const av = n => x[n].allowed_values.map(a => a.name);
const cat = {}; for (const a of x["event.category"].allowed_values) cat[a.name] = a.expected_event_types;
const out = {ecs_version: ver,
  source: `npm @elastic/ecs@${ver}, package/generated/ecs_flat.js export EcsFlat`,
  license: "Apache-2.0, Copyright Elasticsearch B.V. (see ECS-LICENSE.txt)",
  shape: "fields: flat_name -> [es_type] or [es_type, \"array\"]; allowed: the four fields with allowed_values; event.category maps each category to its expected_event_types",
  required: Object.keys(x).filter(k => x[k].required),
  allowed: {"event.kind": av("event.kind"), "event.category": cat, "event.type": av("event.type"), "event.outcome": av("event.outcome")},
  fields};
process.stdout.write(JSON.stringify(out).replace(/\],"/g, "],\n\"") + "\n");

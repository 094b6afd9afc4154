// Writes dist/build-info.json with the hash of the build inputs, computed exactly like
// gateway.admin_ui.source_hash() (the gateway and a test check the committed build with it).
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, statSync, writeFileSync } from "node:fs";
import { join, relative, sep } from "node:path";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const FILES = ["index.html", "package.json", "package-lock.json", "tsconfig.json", "vite.config.ts"];
const DIRS = ["src"];

function walk(dir) {
  return readdirSync(dir).flatMap((name) => {
    const p = join(dir, name);
    return statSync(p).isDirectory() ? walk(p) : [p];
  });
}

const files = [...FILES.map((f) => join(root, f)), ...DIRS.flatMap((d) => walk(join(root, d)))];
const lines = files
  .map((p) => `${relative(root, p).split(sep).join("/")}\0${createHash("sha256").update(readFileSync(p)).digest("hex")}\n`)
  .sort();
const source_sha256 = createHash("sha256").update(lines.join("")).digest("hex");
writeFileSync(join(root, "dist", "build-info.json"), JSON.stringify({ source_sha256 }, null, 2) + "\n");
console.log(`dist/build-info.json: ${source_sha256}`);

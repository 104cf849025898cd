// The reference encoders of the tokenizer tests (fetched by
// scripts/fetch_tokenizers.sh): Hugging Face's tokenizers.js encodes texts
// with a tokenizer.json, OpenAI's tiktoken (its npm build) with a named
// encoding, special tokens allowed.
//
//   node reference_encode.mjs MODULES_DIR REQUEST.json RESULT.json
//
// REQUEST: {"tokenizer": path, or "tiktoken": encoding name,
//           "add_special_tokens": bool,
//           "texts_b64": [base64 of each text's raw bytes]}
// RESULT:  {"ids": [[id, ...], ...], "seconds": encode time, "bytes": n}
// Raw bytes are decoded as UTF-8 with U+FFFD for invalid sequences, as a
// file read as text is.
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";
import { createRequire } from "module";

const [modules, requestPath, resultPath] = process.argv.slice(2);
const request = JSON.parse(fs.readFileSync(requestPath, "utf8"));
let encode;
if (request.tiktoken) {
  const require = createRequire(path.resolve(modules) + "/");
  const { get_encoding } = require("tiktoken");
  const enc = get_encoding(request.tiktoken);
  encode = (t) => Array.from(enc.encode(t, "all"));
} else {
  const entry = path.join(modules, "node_modules/@huggingface/tokenizers/dist/tokenizers.mjs");
  const { Tokenizer } = await import(pathToFileURL(entry).href);
  const tokenizer = new Tokenizer(JSON.parse(fs.readFileSync(request.tokenizer, "utf8")), {});
  encode = (t) => tokenizer.encode(t, { add_special_tokens: request.add_special_tokens }).ids;
}
const texts = request.texts_b64.map((b) => Buffer.from(b, "base64").toString("utf8"));
let bytes = 0;
for (const t of texts) bytes += Buffer.byteLength(t, "utf8");
const start = process.hrtime.bigint();
const ids = texts.map(encode);
const seconds = Number(process.hrtime.bigint() - start) / 1e9;
fs.writeFileSync(resultPath, JSON.stringify({ ids, seconds, bytes }));

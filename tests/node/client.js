// A zeroqueue client built with grpc-js and proto-loader, as a Node.js backend team would write it.
//   node client.js ADDRESS API_KEY PROTO_ROOT GOOGLE_PROTOS stream|reject [TIMEOUT_MS]
// Prints one JSON line: the streamed reply, or the decoded google.rpc details of a rejection.
//   node client.js ADDRESS API_KEY PROTO_ROOT GOOGLE_PROTOS burst CALLS_JSON SERVICE_CONFIG_FILE
// burst: a channel with that service config (grpc-js's own retries); once connected it prints {"ready": true}
// and waits for a line on stdin, then starts every call of CALLS_JSON ([{request_id, max_tokens, timeout_ms}])
// at once and prints one JSON line with each call's outcome and wall-clock times (ms since the epoch).
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");
const path = require("path");
const fs = require("fs");
const readline = require("readline");

const [address, apiKey, protoRoot, googleProtos, mode, timeoutMs, serviceConfigFile] = process.argv.slice(2);
const options = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
                  includeDirs: [protoRoot, googleProtos] };
const definition = protoLoader.loadSync("zeroqueue/inference/v1/inference.proto", options);
const { Inference } = grpc.loadPackageDefinition(definition).zeroqueue.inference.v1;
const channelOptions = mode === "burst" ?
  { "grpc.service_config": JSON.stringify(JSON.parse(fs.readFileSync(serviceConfigFile, "utf8"))) } : {};
const client = new Inference(address, grpc.credentials.createInsecure(), channelOptions);

function decodeDetails(metadata) {
  const raw = metadata.get("grpc-status-details-bin")[0];
  if (raw === undefined) return [];        // a status made by the client itself (e.g. its deadline passed)
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => path.join(googleProtos, target);
  root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });
  const status = root.lookupType("google.rpc.Status").decode(raw);
  return status.details.map((any) => {
    const type = root.lookupType(any.type_url.split("/").pop());
    return { type: any.type_url, value: type.toObject(type.decode(any.value), { longs: Number }) };
  });
}

function authorized() {
  const metadata = new grpc.Metadata();
  metadata.add("authorization", `Bearer ${apiKey}`);
  return metadata;
}

// One Generate call; `done` gets its outcome: a reply, or the status code with decoded details and trailers.
function generate(requestId, maxTokens, timeoutMs, done) {
  const started_ms = Date.now();
  const call = client.Generate({ prompt: "def add(a, b):", max_tokens: maxTokens, temperature: 0,
                                 request_id: requestId },
                               authorized(), { deadline: new Date(started_ms + timeoutMs) });
  const reply = { kinds: [], token_ids: [], text: "", started_ms };
  call.on("data", (message) => {
    reply.kinds.push(message.kind);
    if (message.kind === "chunk") {
      reply.token_ids.push(...message.chunk.token_ids);
      reply.text += message.chunk.text;
    } else if (message.kind === "final") {
      reply.finish_reason = message.final.finish_reason;
      reply.completion_tokens = message.final.usage.completion_tokens;
    } else {
      reply.request_id = message.admission.request_id;
    }
  });
  let failed = false;
  call.on("error", (error) => {
    failed = true;
    const trailers = error.metadata.getMap();
    done({ request_id: requestId, code: error.code, details: decodeDetails(error.metadata), started_ms,
           ended_ms: Date.now(), retry_after_ms: trailers["retry-after-ms"],
           pushback_ms: trailers["grpc-retry-pushback-ms"] });
  });
  call.on("end", () => { if (!failed) done({ ...reply, code: 0, ended_ms: Date.now() }); });
}

function burst(calls) {
  client.waitForReady(new Date(Date.now() + 20000), (error) => {
    if (error) throw error;
    console.log(JSON.stringify({ ready: true }));
    readline.createInterface({ input: process.stdin }).once("line", () => {
      const outcomes = [];
      for (const c of calls) {
        generate(c.request_id, c.max_tokens, c.timeout_ms, (outcome) => {
          outcomes.push(outcome);
          if (outcomes.length === calls.length) {
            console.log(JSON.stringify(outcomes));
            process.exit(0);
          }
        });
      }
    });
  });
}

if (mode === "burst") {
  burst(JSON.parse(timeoutMs));
} else {
  generate(`node-${mode}`, 8, Number(timeoutMs || 20000), (outcome) => console.log(JSON.stringify(outcome)));
}

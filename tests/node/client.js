// A zeroqueue client built with grpc-js and proto-loader, as a Node.js backend team would write it.
//   node client.js ADDRESS API_KEY PROTO_ROOT GOOGLE_PROTOS stream|reject [TIMEOUT_MS]
// Prints one JSON line: the streamed reply, or the decoded google.rpc details of a rejection.
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");
const path = require("path");

const [address, apiKey, protoRoot, googleProtos, mode, timeoutMs] = process.argv.slice(2);
const options = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
                  includeDirs: [protoRoot, googleProtos] };
const definition = protoLoader.loadSync("zeroqueue/inference/v1/inference.proto", options);
const { Inference } = grpc.loadPackageDefinition(definition).zeroqueue.inference.v1;
const client = new Inference(address, grpc.credentials.createInsecure());

function decodeDetails(metadata) {
  const raw = metadata.get("grpc-status-details-bin")[0];
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => path.join(googleProtos, target);
  root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });
  const status = root.lookupType("google.rpc.Status").decode(raw);
  return status.details.map((any) => {
    const type = root.lookupType(any.type_url.split("/").pop());
    return { type: any.type_url, value: type.toObject(type.decode(any.value), { longs: Number }) };
  });
}

const deadline = new Date(Date.now() + Number(timeoutMs || 20000));
const metadata = new grpc.Metadata();
metadata.add("authorization", `Bearer ${apiKey}`);
const call = client.Generate({ prompt: "def add(a, b):", max_tokens: 8, temperature: 0, request_id: `node-${mode}` },
                             metadata, { deadline });
const reply = { kinds: [], token_ids: [], text: "" };
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
  console.log(JSON.stringify({ code: error.code, details: decodeDetails(error.metadata),
                               retry_after_ms: trailers["retry-after-ms"] }));
});
call.on("end", () => { if (!failed) console.log(JSON.stringify(reply)); });

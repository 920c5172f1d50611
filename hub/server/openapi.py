"""The hub's HTTP API as an OpenAPI 3.1 document (a plain data structure, served at /v1/openapi.json).

Keep it in step with the route modules: tests check every served route is listed here.
"""

from __future__ import annotations

from typing import Any

from gpuflex.protocol.version import SOFTWARE_VERSION

_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
# A request line or header the HTTP parser refuses (a control character, a bad Content-Length)
# is answered 400 by the server before the API sees it, as plain text.
_ERROR_400 = {"description": "bad request: JSON from the API, or plain text when the HTTP parser refused "
                             "the request line or a header",
              "content": {**_ERROR["content"], "text/plain": {"schema": {"type": "string"}}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): (_ERROR_400 if c == 400 else _ERROR) for c in codes}
_MSGPACK_IN = {"required": True, "content": {"application/x-msgpack": {"schema": {
    "type": "string", "format": "binary", "description": "sealed envelope {payload, signer, sig}"}}}}


def _sealed(kind: str) -> dict[str, Any]:
    return {"description": f"sealed {kind} (signed by the hub key)",
            "content": {"application/x-msgpack": {"schema": {"type": "string", "format": "binary"}}}}


def _json(schema: dict[str, Any], description: str = "ok") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _node_op(summary: str, request_kind: str, response_kinds: str, errors: tuple[int, ...]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary, "tags": ["node"], "requestBody": _MSGPACK_IN | {"description": f"sealed {request_kind}"},
        "responses": {"200": _sealed(response_kinds)} | _errors(*errors),
    }
    return op


_BEARER = [{"bearer": []}]
_JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
_FLAG_ID = {"name": "flag_id", "in": "path", "required": True, "schema": {"type": "string"},
            "description": "a flag id, or any unique prefix of it (with or without the leading f-)"}
_OBJ = {"type": "object"}
_COMPUTE_CLASS: dict[str, Any] = {"type": "object", "description": "the node's ComputeClass ({} when not known)",
                                  "properties": {
    "device_kind": {"type": "string", "enum": ["cpu", "cuda", "mps", "unknown"]},
    "device_model": {"type": "string"}, "capability": {"type": "string"}, "cpu_vendor": {"type": "string"},
    "isa": {"type": "array", "items": {"type": "string"}}, "torch_version": {"type": "string"},
    "cuda_version": {"type": "string"}, "cudnn_version": {"type": "string"}, "onednn": {"type": "boolean"},
    "threads": {"type": "integer"},
    "precisions": {"type": "array", "items": {"type": "string", "enum": ["fp32", "tf32", "bf16", "fp16"]}}}}
_NODE: dict[str, Any] = {"type": "object", "required": ["id", "compute_class", "class_keys"], "properties": {
    "id": {"type": "string"}, "compute_class": _COMPUTE_CLASS,
    "class_keys": {"type": "object", "additionalProperties": {"type": "string"},
                   "description": "precision -> canonical class key (protocol/compute.class_key)"},
    "suspended": {"type": "boolean", "description": "a proven mismatch (an open flag that suspends it): "
                  "no work until an auditor dismisses the flag (lifted) or confirms it (banned)"},
    "suspension": {"type": ["string", "null"], "description": "why it is suspended, in one line"}}}


def _ops_paths() -> dict[str, Any]:
    """The paths the hub's own: liveness, metrics, this document."""
    return {
    "/healthz": {"get": {"summary": "liveness and database check", "tags": ["ops"],
                         "responses": {"200": _json(_OBJ)}}},
    "/metrics": {"get": {"summary": "Prometheus text metrics", "tags": ["ops"],
                         "responses": {"200": {"description": "text/plain; version=0.0.4"}}}},
    "/v1/openapi.json": {"get": {"summary": "this document", "tags": ["ops"],
                                 "responses": {"200": _json(_OBJ)}}},
    }


def _node_paths() -> dict[str, Any]:
    """The paths a node's: the hub's key, registration, work, heartbeats, a silo's schema."""
    return {
    "/v1/hub": {"get": {"summary": "hub public key and fingerprint (pin or trust on first use)",
                        "tags": ["node"], "responses": {"200": _json({"type": "object", "properties": {
                            "public_key": {"type": "string", "description": "hex"},
                            "fingerprint": {"type": "string"},
                            "protocol_version": {"type": "integer"},
                            "server_time": {"type": "number", "description": "the hub's clock (Unix "
                                            "seconds): a node that has not registered yet signs by it"}}})}}},
    "/v1/nodes/register": {"post": _node_op("register a node (hello + benchmark, optional enrollment token);"
                                            " a new identity may be rate-limited (429 with Retry-After)",
                                            "Hello", "Welcome", (400, 401, 403, 409, 413, 429))},
    "/v1/work": {"post": _node_op(
        "long-poll for work (at most min(wait_s, long_poll_max_s)); a node holding a live assignment gets it "
        "again. With request header X-GPUFlex-Inline-Max: N, a model of at most N bytes (and 1 MiB) that the "
        "node does not list as cached follows the sealed assignment in the body; response header "
        "X-GPUFlex-Sealed-Length gives the sealed message's length. When the hub's referee waits on a "
        "checkpoint state of the node's, the answer is a signed StateRequest instead (answer it with "
        "POST /v1/states before its deadline, or say at once which states it no longer holds with "
        "POST /v1/states/unavailable; a node that answers neither way is flagged unverifiable)",
        "WorkRequest", "Assignment, StateRequest or NoWork", (400, 401, 403, 409, 413))},
    "/v1/heartbeat": {"post": _node_op("extend a live assignment's deadline", "Heartbeat",
                                       "Ack (deadline = new deadline; ok=false when no longer live)",
                                       (400, 401, 403, 404, 409))},
    "/v1/abandon": {"post": _node_op("give an assignment back to the pool", "Abandon", "Ack",
                                     (400, 401, 403, 404, 409))},
    "/v1/silos/schema": {"post": _node_op(
        "what a silo of a node-local job must hold: the model's input and outputs, the sample bounds, whether "
        "the job asks for label histograms, and the blob id of the silo this node attached (if any)",
        "SiloQuery", "SiloSchema", (400, 401, 403, 404, 409))},
    }


def _secagg_paths() -> dict[str, Any]:
    """The paths secure aggregation's four steps and its poll."""
    return {
    "/v1/secagg/keys": {"post": _node_op(
        "secure aggregation, step 1: this member's two fresh public keys for the round (after it trained)",
        "SecAggKeys", "SecAggState", (400, 401, 403, 404, 409, 422))},
    "/v1/secagg/poll": {"post": _node_op(
        "where the round's secure aggregation stands for this member (roster, survivors, its inbox of "
        "encrypted shares, who to unmask); a long-poll with after (the phase the member last saw) and "
        "wait_s: answered once its phase moves on, or at min(wait_s, long_poll_max_s)", "SecAggPoll",
        "SecAggState", (400, 401, 403, 404, 409))},
    "/v1/secagg/shares": {"post": _node_op(
        "secure aggregation, step 2: one encrypted share for each other member of the roster",
        "SecAggShares", "SecAggState", (400, 401, 403, 404, 409, 422))},
    "/v1/secagg/masked": {"post": {
        "summary": "secure aggregation, step 3: the masked update (uint32 little-endian); header "
                   "X-GPUFlex-Masked is the urlsafe base64 of a sealed SecAggMasked naming its size and SHA-256. "
                   "Stored durably before the 2xx",
        "tags": ["node"],
        "parameters": [{"name": "X-GPUFlex-Masked", "in": "header", "required": True,
                        "schema": {"type": "string"}}],
        "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                            "format": "binary"}}}},
        "responses": {"200": {"description": "sealed SecAggState"},
                      **{str(c): {"description": "error"} for c in (400, 401, 403, 404, 409, 413, 422)}}}},
    "/v1/secagg/unmask": {"post": _node_op(
        "secure aggregation, step 4: the shares that unmask the sum (of survivors' seeds, of dropped members' "
        "mask keys; never both for one member)", "SecAggUnmask", "SecAggState", (400, 401, 403, 404, 409, 422))},
    }


def _silo_paths() -> dict[str, Any]:
    """The paths a node-local job's silos: attach and withdraw."""
    return {
    "/v1/silos": {"post": _node_op(
        "attach this node's silo to a node-local job: its blob id, size, sample count and (opt-in) label "
        "histogram; never a row. Durable before the 2xx; the node trains it from the next round it asks in",
        "SiloRegistration", "Ack (detail: attached | replaced | attached already)", (400, 401, 403, 404, 409, 422))},
    "/v1/silos/withdraw": {"post": _node_op(
        "withdraw this node's silo of a node-local job (its operator removed it): no longer assigned, no round "
        "waits for it; a live assignment of it ends. Durable before the 2xx; idempotent",
        "SiloWithdrawal", "Ack (detail: withdrawn | not attached: nothing to withdraw)",
        (400, 401, 403, 404, 409, 422))},
    }


def _blob_paths() -> dict[str, Any]:
    """The paths blobs a node downloads: whole, or as a delta from an earlier model."""
    return {
    "/v1/blobs/{sha256}": {"get": {
        "summary": "a model or chunk blob named by a live assignment of the caller; supports Range",
        "tags": ["node"],
        "parameters": [
            {"name": "sha256", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
            {"name": "X-GPUFlex-Auth", "in": "header", "required": True,
             "schema": {"type": "string"}, "description": "urlsafe base64 of a sealed BlobRequest"},
            {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"}},
        ],
        "responses": {"200": {"description": "blob bytes"}, "206": {"description": "partial blob"},
                      **_errors(400, 401, 403, 404, 409, 416)}}},
    "/v1/blobs/{sha256}/from/{base}": {"get": {
        "summary": "a model as a delta (GFD1: shuffled XOR, deflated) from an earlier model of the same job",
        "tags": ["node"],
        "parameters": [
            {"name": "sha256", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
            {"name": "base", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
            {"name": "X-GPUFlex-Auth", "in": "header", "required": True,
             "schema": {"type": "string"}, "description": "urlsafe base64 of a sealed BlobRequest for sha256"},
        ],
        "responses": {"200": {"description": "the delta (protocol/blobdelta.py); X-GPUFlex-Delta-From names the base"},
                      **_errors(400, 401, 403, 404)},
        "description": "sha256 must be the model of a live assignment of the caller (403 not_assigned), base an "
                       "earlier model of that job the hub still names (404 no_delta otherwise, and when the two "
                       "differ in layout): the node applies it to the base it holds and checks the result against "
                       "the signed model_hash; on 404 it downloads the whole model"}},
    }


def _relay_paths() -> dict[str, Any]:
    """The pipeline relay: stages hand activations and gradients to each other through the hub."""
    return {
        "/v1/relay": {
            "post": {
                "summary": "pipeline relay: hand one activation, gradient or tied gradient to another stage",
                "tags": ["node"],
                "parameters": [{"name": "X-GPUFlex-Relay", "in": "header", "required": True,
                                "schema": {"type": "string"}, "description": "urlsafe base64 of a sealed RelayHeader"}],
                "requestBody": {"required": True, "content": {"application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"}}}},
                "responses": {"200": _sealed("Ack"), **_errors(400, 401, 403, 404, 409, 413, 422, 429)},
                "description": "The body is one GFT1 tensor of the header's size and SHA-256, kept in memory only "
                               "until the receiving stage takes it. 404 no_pipeline; 403 not_your_stage / "
                               "not_your_step; 400 not_in_plan / size_mismatch / hash_mismatch; 413 too_large; "
                               "422 bad_tensor (shape, dtype) / nonfinite; 409 relay_duplicate / replay; "
                               "429 relay_full"},
            "get": {
                "summary": "pipeline relay: take the tensor sent to this node's stage (long-poll)",
                "tags": ["node"],
                "parameters": [{"name": "X-GPUFlex-Auth", "in": "header", "required": True,
                                "schema": {"type": "string"}, "description": "urlsafe base64 of a sealed RelayTake"}],
                "responses": {"200": {"description": "the GFT1 tensor; header X-GPUFlex-Relay carries the sender's "
                                                     "sealed RelayHeader as it came",
                                      "content": {"application/octet-stream": {
                                          "schema": {"type": "string", "format": "binary"}}}},
                              "204": {"description": "nothing came within the wait"},
                              **_errors(400, 401, 403, 404, 409)}}},
    }


def _pipeline_paths() -> dict[str, Any]:
    """A pipelined job's stage nodes: unit checkpoints and step reports (hub/server/routes_pipeline.py)."""
    return {
        "/v1/nodes/probe": {"post": {
            "summary": "a node's link probe: the hub times the body to measure the node's uplink",
            "tags": ["node"],
            "parameters": [{"name": "X-GPUFlex-Auth", "in": "header", "required": True,
                            "schema": {"type": "string"}, "description": "urlsafe base64 of a sealed LinkProbe"}],
            "requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": _sealed("Ack"), **_errors(400, 401, 403, 404, 409, 413, 422)},
            "description": "The body is size bytes (at most 1 MiB) hashing to the signed sha256; the node sends one "
                           "after it registers. The Ack's detail says the rate measured. 400 size_mismatch; "
                           "413 too_large; 422 hash_mismatch"}},
        "/v1/pipeline/checkpoint": {"post": {
            "summary": "a pipeline stage's unit state at a checkpoint step, stored durably before the 200",
            "tags": ["node"],
            "parameters": [{"name": "X-GPUFlex-Auth", "in": "header", "required": True,
                            "schema": {"type": "string"}, "description": "urlsafe base64 of a sealed UnitCheckpoint"}],
            "requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": _sealed("Ack"), **_errors(400, 401, 403, 404, 409, 413, 422)},
            "description": "The body is the unit's GFT1 state: exactly its state-dict entries (names, shapes, "
                           "dtypes) plus optim.* entries of its optimizer, all finite. 404 unknown_job; 409 "
                           "stale_generation / replay; 403 not_your_stage / not_your_unit; 400 "
                           "not_a_checkpoint_step / size_mismatch; 413 too_large; 422 hash_mismatch / "
                           "bad_state / nonfinite"}},
        "/v1/pipeline/report": {"post": {
            "summary": "a pipeline stage's report of a step (its liveness); ok=false: the generation is over",
            "tags": ["node"],
            "requestBody": {"required": True, "content": {"application/x-msgpack": {
                "schema": {"type": "string", "format": "binary"}, "description": "a sealed StageReport"}}},
            "responses": {"200": _sealed("Ack"), **_errors(400, 401, 403, 404, 409, 413)},
            "description": "The answer's ok is false once the generation is over (a re-plan, the job's end): "
                           "the stage stops and asks for work. 404 unknown_job; 403 not_your_stage; 400 "
                           "bad_step / bad_report (update_s above compute_s); 409 replay"}},
    }


def _upload_paths() -> dict[str, Any]:
    """The paths what a node uploads: updates (resumable) and the states the referee asks for."""
    return {
    "/v1/updates": {"post": {
        "summary": "upload a trained update: signed header + raw update blob, streamed and hashed",
        "tags": ["node"],
        "parameters": [{"name": "X-GPUFlex-Update", "in": "header", "required": True, "schema": {"type": "string"},
                        "description": "urlsafe base64 of a sealed UpdateHeader"}],
        "requestBody": {"required": True, "content": {"application/octet-stream": {
            "schema": {"type": "string", "format": "binary"}}}},
        "responses": {"200": _sealed("Ack"), **_errors(400, 401, 403, 404, 409, 411, 413, 422)},
        "description": "The body must carry a Content-Length equal to the header's update_size - offset (411 "
                       "without one). Where the assignment's train.commit asks for a checkpoint commitment, "
                       "400 commitment_required without one and 400 bad_commitment for one that does not cover "
                       "the assignment's steps, before the body is read (the assignment stays live). The tensor names, dtypes and shapes are checked before the size: 422 "
                       "bad_manifest names the first tensor that is not the job's encoding of the model's (its "
                       "[communication] update: fp32 = the model's own tensors; protocol/encoding.py); 422 "
                       "non_finite also for values no encoder makes; 413 too_large only for an "
                       "update whose tensors are the model's but whose bytes are more. 409 late_update / "
                       "duplicate_update / replay; 422 bad_manifest / non_finite / hash_mismatch. Resumable: an "
                       "update over 1 MiB whose body stops short leaves its bytes with the hub (per assignment "
                       "and hash, until the assignment ends); the node asks POST /v1/updates/offset how many and "
                       "sends the rest with the header's offset set to that (409 offset_mismatch otherwise)"}},
    "/v1/updates/offset": {"post": {
        "summary": "how many leading bytes of an interrupted update upload the hub holds",
        "tags": ["node"],
        "parameters": [{"name": "X-GPUFlex-Update", "in": "header", "required": True, "schema": {"type": "string"},
                        "description": "urlsafe base64 of the sealed UpdateHeader of the upload to resume"}],
        "responses": {"200": _sealed("UploadOffset"), **_errors(400, 401, 403, 404, 409)},
        "description": "No body. 404 unknown_assignment when the assignment is not a live one of the caller; "
                       "409 busy while the interrupted upload is still being closed"}},
    "/v1/states": {"post": {
        "summary": "hand over a committed checkpoint state the referee asked for (StateRequest)",
        "tags": ["node"],
        "parameters": [{"name": "X-GPUFlex-State", "in": "header", "required": True, "schema": {"type": "string"},
                        "description": "urlsafe base64 of a sealed StateUpload"}],
        "requestBody": {"required": True, "content": {"application/octet-stream": {
            "schema": {"type": "string", "format": "binary"}}}},
        "responses": {"200": _sealed("Ack"), **_errors(400, 401, 403, 404, 409, 411, 413, 422)},
        "description": "The body is the GFT1 state (protocol/checkpoint.py) with Content-Length = state_size "
                       "(411 without one). 404 unknown_request; 403 not_your_request; 409 late_state (past the "
                       "request's deadline); 400 bad_step / size_mismatch; 422 not_committed (the sha is not "
                       "the one the node's update committed to for that step) / hash_mismatch / bad_state; "
                       "413 too_large"}},
    "/v1/states/unavailable": {"post": _node_op(
        "say at once that the node no longer holds some of the states a StateRequest asked for: the "
        "referee decides without waiting for the deadline, and the update is left out unverified without a "
        "flag. 404 unknown_request; 403 not_your_request; 409 late_state / handed_over; 400 bad_step",
        "StateUnavailable", "Ack", (400, 401, 403, 404, 409))},
    }


def _owner_paths() -> dict[str, Any]:
    """The paths an owner's: jobs, their status and models."""
    return {
    "/v1/jobs": {
        "post": {"summary": "submit a job (owner)", "tags": ["owner"], "security": _BEARER,
                 "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                     "type": "object", "required": ["spec", "train"], "properties": {
                         "spec": {"type": "string", "description": "job spec TOML"},
                         "train": {"type": "string", "format": "binary", "description": ".npz (x, y) or CSV"},
                         "val": {"type": "string", "format": "binary", "description": "optional validation set"},
                         "base": {"type": "string", "format": "binary", "description": "optional: the model to "
                                  "start from, a .safetensors file of the spec's model (docs/lora.md)"}}}}}},
                 "responses": {"201": _json({"$ref": "#/components/schemas/JobCreated"}),
                               **_errors(400, 401, 403, 413, 422)}},
        "get": {"summary": "list jobs (owner: their own; admin: all; an auditor token gets 403)",
                "tags": ["owner"], "security": _BEARER,
                "responses": {"200": _json(_OBJ), "401": _ERROR, "403": _ERROR}}},
    "/v1/jobs/{job_id}": {"get": {"summary": "job status with per-round history (owner of the job, admin)",
                                  "tags": ["owner"], "security": _BEARER, "parameters": [_JOB_ID],
                                  "responses": {"200": _json({"$ref": "#/components/schemas/JobStatus"}),
                                                "401": _ERROR, "403": _ERROR, "404": _ERROR}}},
    "/v1/jobs/{job_id}/plan": {"get": {
        "summary": "the pipeline plan the job would get on the nodes online now: stages, nodes, memory per "
                   "stage against each node's offer, micro-batches, schedule, replicas, predicted step time and "
                   "bubble; or the planner's one-line refusal (200 with `refused`). 409 not_pipelined: the "
                   "model does not pipeline (owner of the job, admin)",
        "tags": ["owner"], "security": _BEARER, "parameters": [_JOB_ID],
        "responses": {"200": _json({"$ref": "#/components/schemas/JobPlan"}), "401": _ERROR, "403": _ERROR,
                      "404": _ERROR, "409": _ERROR}}},
    "/v1/jobs/{job_id}/model": {"get": {
        "summary": "current model, or the model after `round` rounds, as .safetensors (owner of the job, "
                   "admin; never an auditor)", "tags": ["owner"],
        "security": _BEARER,
        "parameters": [_JOB_ID, {"name": "round", "in": "query", "required": False,
                                 "schema": {"type": "integer", "minimum": 0, "maximum": 999_999_999},
                                 "description": "0 = initial model, N = after N rounds"}],
        "responses": {"200": {"description": "safetensors bytes"}, "400": _ERROR_400, "401": _ERROR, "403": _ERROR,
                      "404": _ERROR}}},
    "/v1/jobs/{job_id}/cancel": {"post": {"summary": "cancel a job", "tags": ["owner"], "security": _BEARER,
                                          "parameters": [_JOB_ID],
                                          "responses": {"200": _json(_OBJ), "401": _ERROR, "403": _ERROR,
                                                        "404": _ERROR}}},
    "/v1/jobs/{job_id}/rollback": {"post": {
        "summary": "restore a kept model and continue the job from it: the round before a node's first "
                   "unverified update, or a round (owner of the job, admin)", "tags": ["owner"],
        "security": _BEARER, "parameters": [_JOB_ID],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {
                "before_node": {"type": "string", "maxLength": 128},
                "oldest_kept": {"type": "boolean", "description": "with before_node: when the model before "
                                "the node's first unverified round is no longer kept, restore the oldest kept "
                                "one (a partial rollback: the response's unverified_left stay in the model)"},
                "to_round": {"type": "integer", "minimum": 0, "maximum": 999_999_999}}}}}},
        "responses": {"200": _json(_OBJ), **_errors(400, 401, 403, 404, 409)}}},
    }


def _audit_paths() -> dict[str, Any]:
    """The paths an auditor's: flags and verdicts, the audit log, the nodes."""
    return {
    "/v1/flags": {"get": {"summary": "flags (auditors: all; owners: their jobs)", "tags": ["audit"],
                          "security": _BEARER, "parameters": [
                              {"name": "status", "in": "query", "schema": {"enum": ["open", "confirmed", "dismissed", "moot"]}},
                              {"name": "job", "in": "query", "schema": {"type": "string"}}],
                          "responses": {"200": _json(_OBJ), "400": _ERROR_400, "401": _ERROR}}},
    "/v1/flags/{flag_id}": {"get": {"summary": "one flag with its evidence", "tags": ["audit"],
                                    "security": _BEARER, "parameters": [_FLAG_ID],
                                    "responses": {"200": _json({"$ref": "#/components/schemas/Flag"}),
                                                  "401": _ERROR, "404": _ERROR,
                                                  "409": _ERROR}}},
    "/v1/flags/{flag_id}/verdict": {"post": {
        "summary": "confirm or dismiss a flag (auditor)", "tags": ["audit"], "security": _BEARER,
        "parameters": [_FLAG_ID],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["verdict"], "properties": {
                "verdict": {"enum": ["confirm", "dismiss"]}, "note": {"type": "string", "maxLength": 2000}}}}}},
        "responses": {"200": _json(_OBJ), **_errors(400, 401, 403, 404, 409)}}},
    "/v1/audit-log": {"get": {"summary": "the hash-chained, hub-signed audit log (JSONL)", "tags": ["audit"],
                              "security": _BEARER,
                              "responses": {"200": {"description": "application/jsonl"}, "401": _ERROR,
                                            "403": _ERROR}}},
    "/v1/nodes": {"get": {"summary": "registered nodes with throughput, reputation and compute class "
                                     "(auditor/admin)",
                          "description": "Each node: id, software_version, device, benchmark (with "
                                         "precision_sps: training samples/s per precision), bench_sps, "
                                         "ema_sps, reputation, online, compute_class (the ComputeClass of "
                                         "its hello: device_kind, device_model, capability, cpu_vendor, isa, "
                                         "torch/cuda/cudnn versions, onednn, threads, precisions; {} until "
                                         "it says hello to this hub version) and class_keys (precision -> "
                                         "the canonical class key replicas are matched by).",
                          "tags": ["audit"], "security": _BEARER,
                          "responses": {"200": _json({"type": "object", "required": ["nodes"], "properties": {
                              "nodes": {"type": "array", "items": _NODE}}}), "401": _ERROR,
                                        "403": _ERROR}}},
    }


def _cooldown_paths() -> dict[str, Any]:
    """The paths of the operator's view of a ban's block cooldowns (admin)."""
    return {
    "/v1/cooldowns": {"get": {
        "summary": "address blocks and operators cooling down after a ban (admin)", "tags": ["audit"],
        "security": _BEARER,
        "description": "Each: kind (block | operator), name, node_id and banned_at (the ban that caused it), until, "
                       "remaining_s, lifted (the addresses the operator lifted it for; the block's own name: "
                       "all of it). No new identity registers from a cooled-down block or operator (403 "
                       "cooldown) unless it was lifted for that address.",
        "responses": {"200": _json(_OBJ), **_errors(401, 403)}}},
    "/v1/cooldowns/lift": {"post": {
        "summary": "lift a ban's block cooldown for one IP address or the whole block (admin; in the audit log)",
        "tags": ["audit"], "security": _BEARER,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["address"], "properties": {
                "address": {"type": "string", "maxLength": 100}, "note": {"type": "string", "maxLength": 2000}}}}}},
        "description": "400 bad_address: neither an IP address nor a block as the hub counts them; 409 "
                       "not_cooling: no ban's cooldown covers it now. A later ban in the block cools it down again.",
        "responses": {"200": _json(_OBJ), **_errors(400, 401, 403, 409)}}},
    }


def _schemas() -> dict[str, Any]:
    """The documents the paths refer to (#/components/schemas/...)."""
    return {
        "Error": {"type": "object", "required": ["error", "detail"], "properties": {
            "error": {"type": "string"}, "detail": {"type": "string"}}},
        "JobCreated": {"type": "object", "properties": {
            "id": {"type": "string"}, "name": {"type": "string"}, "state": {"type": "string"},
            "rounds": {"type": "integer"}, "chunks": {"type": "integer"}, "model_hash": {"type": "string"}}},
        "JobStatus": {"type": "object", "properties": {
            "id": {"type": "string"}, "state": {"enum": ["queued", "running", "done", "cancelled", "failed"]},
            "round": {"type": "integer"}, "rounds": {"type": "integer"},
            "progress": {"type": "object", "description": "the live round: chunks, assignments, and why "
                         "nodes online idle (idle: words, or null)"},
            "data": {"type": "object", "description": "chunks, chunk_size, validation_samples, and "
                     "where the validation set came from (validation: words)"},
            # why the open round waits, in words (hub/domain/waits.py)
            "waiting": {"type": "array", "items": {"type": "string"}},
            "history": {"type": "array", "items": {"type": "object", "properties": {
                "round": {"type": "integer"}, "loss": {"type": ["number", "null"]},
                "accuracy": {"type": ["number", "null"]}, "train_loss": {"type": ["number", "null"]},
                "model_hash": {"type": "string"}, "updates": {"type": "array"}, "flags": {"type": "array"},
                "replication_overhead": {"type": "number"}}}}}},
        "JobPlan": _job_plan_schema(),
        "Flag": {"type": "object", "properties": {
            "id": {"type": "string"}, "job_id": {"type": "string"}, "round": {"type": "integer"},
            "update_id": {"type": "string"}, "node_id": {"type": "string"},
            "reason": {"enum": ["replica_mismatch", "outlier", "free_rider", "implausible",
                                "referee_mismatch", "unverifiable", "stage_mismatch"]},
            "evidence": {"type": "object"}, "status": {"enum": ["open", "confirmed", "dismissed", "moot"]},
            "suspends": {"type": "boolean", "description": "a proven mismatch: while open, its node is "
                         "suspended (no work, pending updates held out); listed first in the queue"},
            "verdict_note": {"type": ["string", "null"]}, "auditor": {"type": ["string", "null"]},
            "job_name": {"type": "string"}, "round_evidence": {"type": "object"},
            "update": {"type": "object"},
            "headline": {"type": "string", "description":
                         "the check the flag failed, with its numbers, in one line"},
            "scores": {"type": "array", "description": "each score against its threshold"},
            "referee": {"type": "array", "description":
                        "the referee's re-executed segments (this update's, then its replicas'): node, "
                        "update, round, steps, precision, reason, outcome, distance, threshold, why",
                        "items": {"type": "object"}},
            "layer_evidence": {"type": ["object", "null"], "description":
                               "per-layer norm, centre norm and cosine against the round's centre"}}},
    }


def _job_plan_schema() -> dict[str, Any]:
    """GET /v1/jobs/{job_id}/plan's answer (hub/server/readmodel/plans.py; docs/pipeline.md)."""
    num, integer = {"type": "number"}, {"type": "integer"}
    stage = {"type": "object", "properties": {
        "stage": integer, "first_unit": integer, "end_unit": {**integer, "description": "exclusive"},
        "unit_names": {"type": "array", "items": {"type": "string"}}, "node_id": {"type": "string"},
        "memory_bytes": integer, "offered_bytes": integer,
        "micro_batch_s": {**num, "description": "the predicted time of one micro-batch: compute_s + transfer_s"},
        "compute_s": num, "transfer_s": num, "update_s": num}}
    pipeline = {"type": "object", "properties": {
        "micro_batches": integer, "micro_batch_size": integer, "schedule": {"enum": ["gpipe", "1f1b"]},
        "step_s": num, "bubble_fraction": num, "stages": {"type": "array", "items": stage}}}
    return {"type": "object", "required": ["id", "model", "offers"], "properties": {
        "id": {"type": "string"}, "state": {"type": "string"}, "batch_size": integer,
        "model": {"type": "object", "description": "units, state_bytes (parameters, gradients, optimizer "
                  "state), flops_per_sample (forward + backward)"},
        "offers": {"type": "object", "description": "online (count), nodes (node_id, memory_bytes, flops_per_s, "
                   "speed_from, update_bytes_per_s, unit_overhead_s, rtt_s, rtt_measured, bandwidth_bytes_per_s, bandwidth_measured), left_out "
                   "(count, why), speed (how flops_per_s was derived), link (the bandwidth_bytes_per_s and "
                   "rtt_s of a node not measured, assumed: no node measured, why)"},
        "plan": {"type": "object", "properties": {
            "replicas": integer, "step_s": num, "samples_per_s": {"type": ["number", "null"]},
            "pipelines": {"type": "array", "items": pipeline}}},
        "refused": {"type": "string", "description": "why no plan fits the nodes online, in one line"}}}


def openapi_document() -> dict[str, Any]:
    paths: dict[str, Any] = {**_ops_paths(), **_node_paths(), **_secagg_paths(), **_silo_paths(),
                             **_blob_paths(), **_relay_paths(), **_pipeline_paths(), **_upload_paths(), **_owner_paths(),
                             **_audit_paths(), **_cooldown_paths()}
    for ops in paths.values():  # any operation: a malformed request or an undocumented query parameter
        for method, op in ops.items():
            op["responses"].setdefault("400", _ERROR_400)
            if method == "post":  # a body that stops arriving (hub/server/bodywatch.py)
                op["responses"].setdefault("408", _ERROR)
    return {
        "openapi": "3.1.0",
        "info": {"title": "GPUFlex hub", "version": SOFTWARE_VERSION,
                 "description": "Node-facing routes speak signed msgpack (protocol/messages.py, protocol/signing.py; "
                                "docs/security.md); owner/auditor routes speak JSON with a bearer "
                                "token. An auditor reads flags, the audit log and nodes, not jobs or models. A "
                                "query parameter not listed for an operation is refused (400 bad_query); a "
                                "number in a query is ASCII digits only. A request body that sends no bytes "
                                "for the hub's body idle timeout gets 408 body_idle and its connection is "
                                "closed."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(),
        },
    }

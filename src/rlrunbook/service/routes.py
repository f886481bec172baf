"""The routes the Tinker SDK calls, each a translation of its request into a :class:`ServeState` call.

Answers follow the SDK's reading of them: a body the SDK's own request type refuses is 400 naming the field;
an unknown id is 404; a queued call answers its request id at once and ``/retrieve_future`` long-polls it
(up to :data:`LONG_POLL_S`, then ``try_again``, which the SDK polls again at once), answering protobuf for
``ForwardBackwardOutput`` and ``SampleResponse``, JSON for the rest, and a failure as 200
``{"error": ..., "category": "user"|"server"}``, which the SDK raises as ``RequestFailedError``. A route
this server does not serve is 404 naming the method and path (the SDK's ``NotFoundError``); one of the SDK's
routes that cannot apply to it (``retrieve_futures``, external weights' download URLs, those of
:data:`NOT_OFFERED`) is 400 naming why. Every handler
acts for the caller's tenant (``request.state.tenant``, set by :mod:`rlrunbook.service.admission`); an id of
another tenant is 404, as an unknown one. A heartbeat of an ended session is 410, which stops the SDK's
heartbeat loop; so is one of an id the server does not hold for the key (forgotten, another tenant's or never
made: answered alike).

``GET /api/v1/rlrunbook/status`` (not an SDK route) answers what the server holds for the caller: sessions,
models with the bytes each holds beside the shared base weights, and the resident base models.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import pydantic
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from rlrunbook.errors import InputError, ModelNotFoundError, RlrunbookError
from rlrunbook.service.futures import CallFailedError
from rlrunbook.service.holdings import StorageLimitError, TenantLimitError
from rlrunbook.service.records import ModelRestartedError, SessionEndedError, UnknownIdError, dump
from rlrunbook.service.state import ServeState
from rlrunbook.service.wire import decode_forward_backward

logger = logging.getLogger("rlrunbook.serve")

LONG_POLL_S = 25.0  # under the SDK's 45 s read timeout of /retrieve_future
PROTOBUF = "application/x-protobuf"
# What this server tells the SDK about itself: no compressed bodies, custom losses run client-side (as
# forward + cross_entropy), samples are polled one by one.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "custom_loss_server_side": False,
                 "sample_use_retrieve_futures": False, "sample_join_sampling_session": False}


class BodyTooLargeError(RlrunbookError, ValueError):
    """A request body over the server's limit (HTTP 413)."""


class WeightsInfoRequest(pydantic.BaseModel):
    """``RestClient.get_weights_info_by_tinker_path``'s body (the SDK posts a plain dict)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    tinker_path: str


class FinishSessionRequest(pydantic.BaseModel):
    """``ServiceClient.close(status, detail)``'s body: why the client is done. Read leniently: older SDKs send no
    body, and a reason or field this server does not know must not make a client's close fail (it is recorded as
    no reason)."""

    class Reason(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="ignore")
        type: str | None = None

    model_config = pydantic.ConfigDict(extra="ignore")
    reason: Reason | None = None
    detail: str | None = None

    def known_reason(self) -> str | None:
        reason = self.reason.type if self.reason is not None else None
        return reason if reason in ("success", "errored", "interrupted") else None


class AssignProjectRequest(pydantic.BaseModel):
    """``RestClient.assign_session_project``'s body."""

    model_config = pydantic.ConfigDict(extra="forbid")
    project_id: str


class CheckpointTtlRequest(pydantic.BaseModel):
    """``RestClient.set_checkpoint_ttl``'s body: seconds from now, or None (never expires)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    ttl_seconds: int | None


async def read_body(request: Request) -> bytes:
    """The body, refused past the limit also when the client declared no length (chunked)."""
    limit = request.app.state.max_body_bytes
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BodyTooLargeError(f"request body exceeds this server's limit of {limit} bytes "
                                    "(rlrunbook serve --max-body-mib); send fewer datums per call.")
        parts.append(part)
    return b"".join(parts)


async def read_json(request: Request, model: type[pydantic.BaseModel]):
    """The body as the SDK's request type ``model``; ``InputError`` naming the cause otherwise."""
    raw = await read_body(request)
    try:
        body = model.model_validate(json.loads(raw or b"{}"))
    except json.JSONDecodeError as error:
        raise InputError(f"the body of {request.method} {request.url.path} is not JSON ({error}).") from None
    except RecursionError:
        raise InputError(f"the body of {request.method} {request.url.path} nests too deeply to be a request of "
                         "the SDK.") from None
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, item['loc'])) or 'body'}: {item['msg']}"
                             for item in error.errors()[:5])
        raise InputError(f"the body of {request.method} {request.url.path} is not a {model.__name__}: "
                         f"{problems}.") from None
    seq_id = getattr(body, "seq_id", None)
    if isinstance(seq_id, int) and not -2**63 <= seq_id < 2**63:  # the store keeps it as a 64-bit integer
        raise InputError(f"the body of {request.method} {request.url.path}: its seq_id does not fit in 64 bits; "
                         "the SDK numbers a client's calls 1, 2, 3, ...")
    return body


def answer(handler: Callable[[Request, ServeState], Awaitable[Response]]):
    """A Starlette endpoint of ``handler`` whose anticipated errors become 4xx JSON naming the cause."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, request.app.state.serve)
        except BodyTooLargeError as error:
            return JSONResponse({"detail": str(error)}, status_code=413)
        except ClientDisconnect:  # the client left, or its body ran out of time: nobody reads this answer
            return JSONResponse({"detail": "the client disconnected before its request body arrived."},
                                status_code=400)
        except StorageLimitError as error:  # waiting does not make room: the SDK raises it at once
            return JSONResponse({"detail": str(error)}, status_code=429, headers={"x-should-retry": "false"})
        except TenantLimitError as error:
            return JSONResponse({"detail": str(error)}, status_code=429)
        except SessionEndedError as error:
            return JSONResponse({"detail": str(error)}, status_code=410)
        except ModelRestartedError as error:  # 410, not 409: the SDK retries a 409 for five minutes
            return JSONResponse({"detail": str(error)}, status_code=410)
        except (UnknownIdError, ModelNotFoundError) as error:
            return JSONResponse({"detail": str(error)}, status_code=404)
        except (RlrunbookError, ValueError, TypeError) as error:
            return JSONResponse({"detail": f"{type(error).__name__}: {error}"}, status_code=400)
        except Exception as error:
            logger.exception("%s %s failed", request.method, request.url.path)
            return JSONResponse({"detail": f"internal error in rlrunbook serve: {type(error).__name__}: {error}"},
                                status_code=500, headers={"x-should-retry": "false"})

    endpoint.__name__ = handler.__name__
    return endpoint


def direct(model: type[pydantic.BaseModel], method: str):
    """A handler: the body as ``model``, passed to ``ServeState.<method>`` on a worker thread, its dict as JSON."""
    async def handler(request: Request, serve: ServeState) -> Response:
        body = await read_json(request, model)
        return JSONResponse(await run_in_threadpool(getattr(serve, method), body, request.state.tenant))

    handler.__name__ = method
    return handler


async def forward_backward(request: Request, serve: ServeState) -> Response:
    call = decode_forward_backward(await read_body(request))
    return JSONResponse(await run_in_threadpool(serve.forward_backward, call, request.state.tenant))


async def retrieve_future(request: Request, serve: ServeState) -> Response:
    body = await read_json(request, types.FutureRetrieveRequest)
    rid = body.request_id
    try:
        with serve.holdings.polling(serve.futures.owner(rid)):  # a client waiting for its call is alive
            done, result = await serve.futures.wait(rid, request.state.tenant, LONG_POLL_S)
    except KeyError:
        raise UnknownIdError(f"no request {rid!r} on this server (or its result was delivered more than "
                             "10 minutes ago).") from None
    except CallFailedError as error:  # the call's failure, as the SDK reads it
        return JSONResponse({"error": error.message, "category": error.category})
    if not done:  # the SDK's "try again" shape (its type is not exported by every SDK version)
        return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
    if isinstance(result, bytes):
        return Response(result, media_type=PROTOBUF)
    return JSONResponse(result)


async def client_config(request: Request, serve: ServeState) -> Response:
    await read_body(request)
    return JSONResponse(CLIENT_CONFIG)


async def dynamic_config(request: Request, serve: ServeState) -> Response:
    await read_body(request)
    return JSONResponse(dump(types.ClientDynamicConfigResponse()))


async def telemetry(request: Request, serve: ServeState) -> Response:
    await read_body(request)  # the SDK's events are not kept
    return JSONResponse({"status": "accepted"})


async def healthz(request: Request, serve: ServeState) -> Response:
    return JSONResponse({"status": "ok"})


async def finish_session(request: Request, serve: ServeState) -> Response:
    finish = await read_json(request, FinishSessionRequest)  # an empty body: no reason given
    return JSONResponse(serve.finish(request.path_params["session_id"], request.state.tenant, finish.known_reason()))


async def search_sessions(request: Request, serve: ServeState) -> Response:
    body = await read_json(request, types.SessionSearchRequest)
    return JSONResponse(await run_in_threadpool(serve.search_sessions, body, request.state.tenant))


async def assign_session_project(request: Request, serve: ServeState) -> Response:
    body = await read_json(request, AssignProjectRequest)
    await run_in_threadpool(serve.assign_session_project, request.path_params["session_id"], body.project_id,
                            request.state.tenant)
    return JSONResponse(None)


async def checkpoint_storage_usage(request: Request, serve: ServeState) -> Response:
    project = request.query_params.get("project_id")
    return JSONResponse(await run_in_threadpool(serve.checkpoint_storage_usage, project, request.state.tenant))


async def whoami(request: Request, serve: ServeState) -> Response:
    """``tinker auth login``'s check of a key: which tenant of this server it is (its digest, never the key)."""
    tenant = request.state.tenant
    return JSONResponse({"key_id": 0, "name": tenant, "note": "a key of rlrunbook serve (--api-key)",
                         "details": {"org_details": {"name": "rlrunbook serve"},
                                     "user_details": {"email": ""}}})


async def sampler_info(request: Request, serve: ServeState) -> Response:
    return JSONResponse(await run_in_threadpool(serve.sampler_info, request.path_params["sampler_id"],
                                                request.state.tenant))


async def status(request: Request, serve: ServeState) -> Response:
    return JSONResponse(await run_in_threadpool(serve.status, request.state.tenant))


async def capabilities(request: Request, serve: ServeState) -> Response:
    return JSONResponse(dump(serve.service.get_server_capabilities()))


def _int_query(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise InputError(f"query parameter {name}={raw!r} must be a non-negative integer.")
    return int(raw)


async def weights_info(request: Request, serve: ServeState) -> Response:
    body = await read_json(request, WeightsInfoRequest)
    return JSONResponse(await run_in_threadpool(serve.weights_info, body.tinker_path, request.state.tenant))


def _tenant_call(method: str, *params: str):
    """A route calling ``ServeState.<method>(*path params, tenant)`` in a worker thread."""
    async def handler(request: Request, serve: ServeState) -> Response:
        args = [request.path_params[name] for name in params]
        result = await run_in_threadpool(getattr(serve, method), *args, request.state.tenant)
        return JSONResponse(result)

    handler.__name__ = method
    return handler


def _listing(method: str, default_limit: int):
    async def handler(request: Request, serve: ServeState) -> Response:
        limit, offset = _int_query(request, "limit", default_limit), _int_query(request, "offset", 0)
        return JSONResponse(await run_in_threadpool(getattr(serve, method), limit, offset, request.state.tenant))

    handler.__name__ = method
    return handler


async def delete_checkpoint(request: Request, serve: ServeState) -> Response:
    params = request.path_params
    await run_in_threadpool(serve.delete_checkpoint, params["run_id"], f"{params['kind']}/{params['name']}",
                            request.state.tenant)
    return JSONResponse(None)


async def checkpoint_ttl(request: Request, serve: ServeState) -> Response:
    body = await read_json(request, CheckpointTtlRequest)
    params = request.path_params
    await run_in_threadpool(serve.set_checkpoint_ttl, params["run_id"], f"{params['kind']}/{params['name']}",
                            body.ttl_seconds, request.state.tenant)
    return JSONResponse(None)


async def copy_weights(request: Request, serve: ServeState) -> Response:
    body = await read_json(request, types.CopyWeightsRequest)
    key = request.headers.get("x-idempotency-key")  # one per copy, the same on the SDK's retries
    return JSONResponse(await run_in_threadpool(serve.copy_weights, body, request.state.tenant, key))


def _publication(method: str):
    """``POST`` (publish) or ``DELETE`` (unpublish) ``.../checkpoints/{kind}/{name}/publish``."""
    async def handler(request: Request, serve: ServeState) -> Response:
        await read_body(request)
        params = request.path_params
        await run_in_threadpool(getattr(serve, method), params["run_id"], f"{params['kind']}/{params['name']}",
                                request.state.tenant)
        return JSONResponse(None)

    handler.__name__ = method
    return handler


# Routes of the SDK that cannot apply to this server, each answered 400 (the SDK's BadRequestError) with why.
RETRIEVE_FUTURES_REFUSED = (
    "rlrunbook serve does not serve /retrieve_futures: its /client/config answers sample_use_retrieve_futures="
    "false, so the SDK polls each sample with /retrieve_future; a client that ignores the config must do the same.")
NOT_OFFERED = {  # (method, path): why this server cannot serve it; each answered 400 (not retried)
    ("POST", "/auth/token"): "rlrunbook serve takes the API key itself (X-API-Key); its /client/config answers "
                             "pjwt_auth_enabled=false, so the SDK exchanges no token.",
    ("DELETE", "/auth/apikey/me"): "rlrunbook serve's keys are set when it starts (--api-key or "
                                   "RLRUNBOOK_SERVE_API_KEY); the operator removes one by restarting without it.",
    ("POST", "/create_custom_loss"): "custom losses run in the client here: /client/config answers "
                                     "custom_loss_server_side=false, and the SDK sends forward + cross_entropy.",
    ("POST", "/join_sampling_session"): "/client/config answers sample_join_sampling_session=false: a sampling "
                                        "client is made with /create_sampling_session.",
    ("POST", "/cancel_future"): "/client/dynamic_config answers sample_cancel_enabled=false: an abandoned sample "
                                "finishes, and its session's expiry releases what it held.",
    ("GET", "/sessions/{session_id}/trace_export"): "rlrunbook serve builds no Perfetto traces of sessions; "
                                                    "`rlrunbook serve` logs each call, and a run's own records "
                                                    "are in its log folder.",
    ("GET", "/billing/usage/events"): "rlrunbook serve bills nothing; "
                                      "AdminClient.get_current_checkpoint_storage_usage() answers what your "
                                      "checkpoints hold on its disk.",
    ("GET", "/audit"): "rlrunbook serve keeps no audit log of organisation events; it has no organisations, only "
                       "the keys it was started with.",
}
EXTERNAL_URLS_REFUSED = (
    "rlrunbook serve hands out no download URLs for external weights: the files stay in the server's storage. "
    "Read them on the server's machine (LocalRestClient(...).get_external_weights_urls(path) with "
    "TINKER_LOCAL_STORAGE set to the server's --storage), or load the checkpoint through the server.")


def _refused(reason: str):
    async def handler(request: Request, serve: ServeState) -> Response:
        await read_body(request)
        return JSONResponse({"detail": reason}, status_code=400, headers={"x-should-retry": "false"})

    handler.__name__ = "refused"
    return handler


async def not_served(request: Request, serve: ServeState) -> Response:
    return JSONResponse({"detail": f"rlrunbook serve does not implement {request.method} {request.url.path}; "
                                   "docs/serve.md lists what it serves."}, status_code=404)


def routes() -> list[Route]:
    """Every route, then a catch-all naming what is not served."""
    api = "/api/v1"
    post = [
        ("/client/config", client_config), ("/client/dynamic_config", dynamic_config),
        ("/create_session", direct(types.CreateSessionRequest, "create_session")),
        ("/session_heartbeat", direct(types.SessionHeartbeatRequest, "heartbeat")),
        ("/sessions/{session_id}/finish", finish_session), ("/telemetry", telemetry),
        ("/create_model", direct(types.CreateModelRequest, "create_model")),
        ("/get_info", direct(types.GetInfoRequest, "get_info")),
        ("/forward_backward", forward_backward),
        ("/optim_step", direct(types.OptimStepRequest, "optim_step")),
        ("/save_weights", direct(types.SaveWeightsRequest, "save_weights")),
        ("/save_weights_for_sampler", direct(types.SaveWeightsForSamplerRequest, "save_weights_for_sampler")),
        ("/load_weights", direct(types.LoadWeightsRequest, "load_weights")),
        ("/create_sampling_session", direct(types.CreateSamplingSessionRequest, "create_sampling_session")),
        ("/asample", direct(types.SampleRequest, "sample")),
        ("/retrieve_future", retrieve_future), ("/weights_info", weights_info),
        ("/save_weights_external", direct(types.SaveWeightsExternalRequest, "save_weights_external")),
        ("/copy_weights", copy_weights), ("/retrieve_futures", _refused(RETRIEVE_FUTURES_REFUSED)),
        ("/sessions/search", search_sessions),
    ]
    get = [
        ("/healthz", healthz), ("/get_server_capabilities", capabilities),
        ("/samplers/{sampler_id}", sampler_info), ("/rlrunbook/status", status),
        ("/training_runs", _listing("training_runs", 20)),
        ("/training_runs/{run_id}", _tenant_call("training_run", "run_id")),
        ("/training_runs/{run_id}/checkpoints", _tenant_call("run_checkpoints", "run_id")),
        ("/checkpoints", _listing("user_checkpoints", 100)),
        ("/sessions", _listing("list_sessions", 20)),
        ("/sessions/{session_id}", _tenant_call("get_session", "session_id")),
        ("/billing/usage/checkpoints/current", checkpoint_storage_usage), ("/auth/apikey/me", whoami),
    ]
    checkpoint = "/training_runs/{run_id}/checkpoints/{kind}/{name}"
    table = [Route(api + path, answer(handler), methods=["POST"]) for path, handler in post]
    table += [Route(api + path, answer(handler), methods=["GET"]) for path, handler in get]
    table += [Route(api + checkpoint, answer(delete_checkpoint), methods=["DELETE"]),
              Route(api + checkpoint + "/ttl", answer(checkpoint_ttl), methods=["PUT"]),
              Route(api + checkpoint + "/publish", answer(_publication("publish")), methods=["POST"]),
              Route(api + checkpoint + "/publish", answer(_publication("unpublish")), methods=["DELETE"]),
              Route(api + checkpoint + "/external_weights_urls", answer(_refused(EXTERNAL_URLS_REFUSED)),
                    methods=["GET"]),
              Route(api + "/sessions/{session_id}/project", answer(assign_session_project), methods=["PUT"])]
    table += [Route(api + path, answer(_refused(reason)), methods=[method])
              for (method, path), reason in NOT_OFFERED.items()]
    every = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return [*table, Route("/{path:path}", answer(not_served), methods=every)]

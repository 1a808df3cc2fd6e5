"""The server's HTTP/API front end: what a client of a real server measures beyond engine steps.

vLLM's `benchmark_serving` and every load generator time a request at the client, from the moment
it is sent to the moment the streamed response ends. Part of that time is no engine step: the API
server parses the request and tokenises the prompt before the request reaches the engine's queue
(vLLM V1: `AsyncLLM.add_request` runs the `InputProcessor` and only then hands the request to
`EngineCoreClient.add_request`, vllm/v1/engine/async_llm.py), and each output the engine produces is
detokenised and streamed back afterwards (`AsyncLLM.output_handler` -> `OutputProcessor.process_outputs`).
On the real vLLM H100 runs of ../shared/calibration the client's TTFT exceeds engine steps by some 15-25
ms; about half of it is vLLM's async scheduling (an arrival waits one more step:
`backend.async_scheduling`), the rest, 7.3 ms per request, is what `testbed-validate` fits here
(`frontend=vllm_api`).

A first-order model with four figures (`FrontendConfig`): a request reaches the engine's queue
`request_s + prompt_token_s x prompt_len` after it reached the server, so the engine's queueing
and every scheduling decision see that later arrival; each output token reaches the client
`output_token_s` after the engine produced it; the response ends `completion_s` after the last
token. The engine itself is untouched: the simulator replays the shifted requests
(`to_engine_queue`) and the request table turns engine times into the client's (`ClientClock`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Sequence

from testbed.core.bounds import bounded, check_ranges
from testbed.core.request import Request

_WHY_SIM_ONLY = "the engine and vLLM replays hand requests to the engine directly, with no HTTP front end"


@dataclass
class FrontendConfig:
    """The front end's delays, in seconds (`frontend=none`: all zero, the engine's own times)."""

    name: str = "none"
    request_s: float = bounded(0.0, ge=0, sim_only=_WHY_SIM_ONLY)  # per request, arrival at the server -> engine queue
    prompt_token_s: float = bounded(0.0, ge=0, sim_only=_WHY_SIM_ONLY)  # per prompt token (tokenisation), also before the queue
    output_token_s: float = bounded(0.0, ge=0, sim_only=_WHY_SIM_ONLY)  # on each streamed token's delivery (detokenise, stream)
    completion_s: float = bounded(0.0, ge=0, sim_only=_WHY_SIM_ONLY)  # after the last token until the response ends

    def validate(self) -> None:
        check_ranges(self, "frontend")

    def queue_delay_s(self, req: Request) -> float:
        """From the request's arrival at the server to its arrival in the engine's queue."""
        return self.request_s + self.prompt_token_s * req.prompt_len

    @property
    def delays_arrivals(self) -> bool:
        return self.request_s > 0 or self.prompt_token_s > 0

    @property
    def is_off(self) -> bool:
        """No delay anywhere: the client sees the engine's own times."""
        return not (self.delays_arrivals or self.output_token_s > 0 or self.completion_s > 0)


@dataclass(frozen=True)
class ClientClock:
    """Turns the engine's times for a request into the times its client sees.

    `arrival_s` is each request's arrival at the server (the trace's time), by request id; the
    engine's own arrival is the one its `Request` carries. A token's delivery is `output_token_s`
    after the engine produced it, the response's end `completion_s` after the last token's.
    """

    arrival_s: dict[int, float]
    output_token_s: float = 0.0
    completion_s: float = 0.0

    @property
    def tail_s(self) -> float:
        """From the engine's finish to the end of the response at the client."""
        return self.output_token_s + self.completion_s


def to_engine_queue(requests: Sequence[Request], frontend: FrontendConfig) -> tuple[list[Request], ClientClock]:
    """The requests as the engine's queue receives them, in the order it receives them, and the
    clock that turns the engine's times back into the client's.

    A request's engine arrival is its trace arrival plus its front-end delay; a longer prompt
    takes longer to tokenise, so a request can reach the engine after one the client sent later
    (the order is by engine arrival, ties kept in trace order). With no arrival delay the
    requests are returned as they are (the same objects, the same order).
    """
    frontend.validate()
    clock = ClientClock({r.id: r.arrival for r in requests}, frontend.output_token_s, frontend.completion_s)
    if not frontend.delays_arrivals:
        return list(requests), clock
    request_s, prompt_token_s = frontend.request_s, frontend.prompt_token_s  # queue_delay_s's terms
    shifted = [Request(r.id, r.arrival + (request_s + prompt_token_s * r.prompt_len), *_after_arrival(r))
               for r in requests]
    shifted.sort(key=lambda r: r.arrival)  # stable: equal engine arrivals keep the trace's order
    return shifted, clock


# a Request's fields after `arrival`, in order: a shifted copy built positionally (dataclasses.replace,
# by keyword, took three times as long: 0.2 s for the Azure conv trace's 19,366 requests)
_FIELDS = [f.name for f in fields(Request)]
assert _FIELDS[:2] == ["id", "arrival"], _FIELDS
_after_arrival = attrgetter(*_FIELDS[2:])


def without_frontend(cfg, tool: str):
    """`cfg` with no HTTP front end, for the tools whose real side is our engine or vLLM (`testbed-profile`,
    `testbed-fidelity`, `testbed-referee`): those hand requests to the engine directly, and the simulation
    they compare with must not add a front end the real side lacks. The frontend group's default
    (`vllm_api`, the simulator's: conf/config.yaml) gives way to `none`; a front end chosen on the command
    line is refused, naming it. Backend groups engine and vllm choose `none` themselves (conf/backend/)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    node = cfg.get("frontend")
    if node is None or node.get("name", "none") == "none":
        return cfg
    if HydraConfig.initialized() and any(o.lstrip("+~").startswith("frontend") for o in HydraConfig.get().overrides.task):
        raise ValueError(f"frontend={node.name}: {tool} compares the simulator with the engine or vLLM, which have no HTTP "
                         f"front end ({_WHY_SIM_ONLY}); leave the frontend group out, or set frontend=none")
    cfg = cfg.copy()
    with open_dict(cfg):
        for key, value in vars(FrontendConfig()).items():
            cfg.frontend[key] = value
    return cfg

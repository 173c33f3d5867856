"""A router in a process of its own: it streams one long completion (2,000 tokens) from a replica, says
STREAMING, and waits to be killed (tests/integration/test_channels.py).

    python router_process.py GCS_ADDRESS ACTOR_NAME
"""

from __future__ import annotations

import asyncio
import json
import sys

import ray

from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.wire import HttpRequest, RoutingFacts


async def main(actor_name: str) -> None:
    actor = ray.get_actor(actor_name, namespace="atomr")
    table = RoutingTable(1, {"emu": DeploymentRoute("emu", 8, "queue", (ReplicaRoute("r", actor_name, actor),))})

    async def source(version):
        return table if version != table.version else None

    body = json.dumps({"model": "emu", "prompt": "count", "max_tokens": 2000, "stream": True}).encode()
    request = HttpRequest("POST", "/v1/completions", (("content-type", "application/json"),), body)
    items = Router(source).stream(RoutingFacts.of_http(request), request)
    await anext(items)  # the head
    await anext(items)  # tokens are flowing
    print("STREAMING", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    ray.init(address=sys.argv[1], namespace="atomr", log_to_driver=False)
    asyncio.run(main(sys.argv[2]))

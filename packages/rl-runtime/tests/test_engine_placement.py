"""Engines of several GPUs (SGLang tensor parallel, ``--rollout-num-gpus-per-engine``) on real
Ray: 4 GPUs declared to a CPU-only Ray, so placement, Ray's GPU ids and the
``CUDA_VISIBLE_DEVICES`` each engine's TP ranks would inherit are the real ones (issue #21,
item 7: before, every engine got one GPU whatever its TP size)."""

from __future__ import annotations

import os
import sys

import pytest
import ray

from rl_runtime import RolloutGroup, create_placement, init_ray

# Ray start-up and actors on 2 shared cores take longer than a few seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class DeviceProbe:
    """An engine that answers each request with the GPUs its process may use."""

    def generate(self, requests, params):
        return [os.environ.get("CUDA_VISIBLE_DEVICES") for _ in requests]

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _identity(prompt):
    return prompt


@pytest.fixture(scope="module")
def ray_4_gpus():
    init_ray(num_cpus=2, num_gpus=4)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def _devices(placement, num_engines: int) -> list[set[str]]:
    group = RolloutGroup(
        DeviceProbe,
        num_engines=num_engines,
        placement=placement,
        request_fn=_identity,
        params_fn=dict,
        num_cpus=0.1,
    )
    try:
        answers = group.generate(list(range(num_engines)), n=1)
    finally:
        group.shutdown()
    return [set(a[0].split(",")) for a in answers]


def test_issue21_item7_colocated_engines_get_n_gpus_each(ray_4_gpus):
    placement = create_placement(
        num_trainers=4,
        num_engines=2,
        colocate=True,
        use_gpu=True,
        cpus_per_bundle=0.1,
        gpus_per_engine=2,
    )
    try:
        assert placement.num_bundles == 4 and placement.engine_bundles == [0, 2]
        engines = _devices(placement, 2)
    finally:
        placement.remove()
    assert [len(d) for d in engines] == [2, 2]
    assert engines[0] | engines[1] == {"0", "1", "2", "3"}  # disjoint, every GPU used


def test_issue21_item7_separate_engine_gets_a_bundle_of_n_gpus(ray_4_gpus):
    placement = create_placement(
        num_trainers=2,
        num_engines=1,
        colocate=False,
        use_gpu=True,
        cpus_per_bundle=0.1,
        gpus_per_engine=2,
    )
    try:
        assert placement.engine_gpus == 2 and placement.engine_devices is None
        (engine,) = _devices(placement, 1)  # Ray itself shows the actor its 2 GPUs
    finally:
        placement.remove()
    assert len(engine) == 2

"""FLUX.2 [klein] rows denoised together (engine/images/batch.py) on a tiny random model: each row's image is the
one it makes alone, and mflux's own generate_image makes it too; a row that stops leaves the others as they were."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.images.batch import BatchRow, generate_batch
from engine.images.families import FAMILIES
from engine.images.generator import ImageGenerator, ImageSpec


class Gone(Exception):
    pass


@pytest.fixture(scope="module")
def generator(tiny_klein) -> ImageGenerator:
    return ImageGenerator(tiny_klein, FAMILIES["flux2-klein-4b"])


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def alone(generator):
    """A spec's image made in a batch of its own, made once per module (the same spec makes the same pixels: the
    first test checks it against mflux's own generate_image); each cost ~1.5 s on this 2-core machine (the module
    alone: 42 s; 500 s while the suite pinned OpenBLAS kernels that slowed MLX's exp ~50x, tests/__init__.py)."""
    made: dict[str, np.ndarray] = {}

    def image_alone(spec: ImageSpec) -> np.ndarray:
        if repr(spec) not in made:
            made[repr(spec)] = pixels(generate_batch(generator.model, [BatchRow(spec, None)])[0])
        return made[repr(spec)]

    return image_alone


SPECS = [ImageSpec("a puffin on a cliff", 64, 48, 2, 1.0, seed=1), ImageSpec("a red dragon", 64, 48, 2, 1.0, seed=2),
         ImageSpec("a puffin", 64, 48, 2, 1.0, seed=3)]
GUIDED = [ImageSpec("a puffin", 64, 48, 2, 3.0, seed=5), ImageSpec("a red dragon", 64, 48, 2, 3.0, seed=6)]


@pytest.mark.parametrize("specs", [SPECS, GUIDED], ids=["plain", "guidance-3"])
def test_each_row_of_a_batch_is_the_image_it_makes_alone_and_mflux_makes(generator, alone, specs):
    """Exact on the CPU (a GPU's batched kernels may round differently)."""
    batched = generate_batch(generator.model, [BatchRow(spec, None) for spec in specs])
    for spec, image in zip(specs, batched):
        assert np.array_equal(pixels(image), alone(spec)), spec
        assert np.array_equal(alone(spec), pixels(generator.generate(spec))), spec


def test_a_row_that_stops_leaves_and_the_others_finish_as_alone(generator, alone):
    steps: list[tuple[int, int]] = []

    def gone_at_first_step(done: int, total: int) -> None:
        raise Gone()

    rows = [BatchRow(SPECS[0], lambda done, total: steps.append((done, total))), BatchRow(SPECS[1], gone_at_first_step),
            BatchRow(SPECS[2], None)]
    images = generate_batch(generator.model, rows)
    assert images[1] is None and isinstance(rows[1].failure, Gone)
    assert steps == [(1, 2), (2, 2)]
    for index in (0, 2):
        assert np.array_equal(pixels(images[index]), alone(SPECS[index]))


def test_the_worker_denoises_waiting_images_of_one_size_together(generator, alone):
    from engine.images.worker import ImageWorker

    release = threading.Event()

    def load():
        release.wait(30)  # the tasks below are all waiting when the worker first looks
        return generator

    worker = ImageWorker(load, max_batch=2)
    other_size = ImageSpec("a red dragon", 48, 64, 2, 1.0, seed=4)
    futures = [worker.submit(spec) for spec in (*SPECS, other_size)]
    release.set()
    images = [future.result(timeout=120) for future in futures]
    worker.close()
    assert (worker.stats.batches, worker.stats.images, worker.stats.largest_batch) == (3, 4, 2)  # 2 + 1 + 1
    assert images[3].size == (48, 64)
    for spec, image in zip(SPECS, images):
        assert np.array_equal(pixels(image), alone(spec))

"""Several FLUX.2 [klein] images of one size denoised together: one transformer forward a step for the whole batch.

mflux's generate_image makes one image; its transformer and VAE take a batch. This loop is generate_image's for a
batch, from mflux's public parts (the prompt encoder, the latent creator, the scheduler, the transformer, the VAE):
each row's prompt is encoded and its noise drawn exactly as alone (so a row's image does not depend on its batch),
then every step runs the rows together. A row whose step callback raises (its client gone) leaves the batch there;
the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass
import mlx.core as mx

from engine.images.generator import ImageSpec, OnStep

TEXT_ENCODER_LAYERS = (9, 18, 27)  # the hidden states FLUX.2 [klein] reads, as mflux's generate_image does
MAX_SEQUENCE_LENGTH = 512
NEGATIVE_PROMPT = " "  # mflux's for guidance above 1


@dataclass
class BatchRow:
    spec: ImageSpec
    on_step: OnStep | None
    failure: BaseException | None = None  # what its callback raised: the row left the batch


def batch_key(spec: ImageSpec) -> tuple:
    """Rows that can share a batch: one size, one step count, one guidance (one scheduler, one forward shape)."""
    return spec.width, spec.height, spec.steps, spec.guidance


def generate_batch(model, rows: list[BatchRow]) -> list:
    """Each row's PIL image (None for a row that left); all rows share batch_key."""
    from mflux.models.common.config.config import Config
    from mflux.models.flux2.latent_creator.flux2_latent_creator import Flux2LatentCreator
    from mflux.utils.image_util import ImageUtil

    first = rows[0].spec
    config = Config(model_config=model.model_config, num_inference_steps=first.steps, height=first.height,
                    width=first.width, guidance=first.guidance, scheduler="flow_match_euler_discrete")
    embeds, text_ids = _stacked([_encoded(model, row.spec.prompt) for row in rows])
    negative = _encoded(model, NEGATIVE_PROMPT) if first.guidance > 1.0 else None
    noise = [Flux2LatentCreator.prepare_packed_latents(seed=row.spec.seed, height=first.height, width=first.width,
                                                        batch_size=1) for row in rows]
    latents, latent_ids = _stacked([(n[0], n[1]) for n in noise])
    latent_height, latent_width = noise[0][2], noise[0][3]
    live = list(range(len(rows)))
    for t in range(config.init_time_step, config.num_inference_steps):
        timestep = config.scheduler.timesteps[t]
        predicted = _predict(model, latents, latent_ids, embeds, text_ids, negative, first.guidance, timestep)
        latents = config.scheduler.step(noise=predicted, timestep=t, latents=latents, sigmas=config.scheduler.sigmas)
        mx.eval(latents)
        keep = [place for place, index in enumerate(live) if _stepped(rows[index], t + 1, config.num_inference_steps)]
        if len(keep) < len(live):
            if not keep:
                return [None] * len(rows)
            chosen = mx.array(keep)
            latents, latent_ids, embeds, text_ids = (a[chosen] for a in (latents, latent_ids, embeds, text_ids))
            live = [live[place] for place in keep]
    packed = latents.reshape(len(live), latent_height, latent_width, -1).transpose(0, 3, 1, 2)
    decoded = model.vae.decode_packed_latents(packed, tiling_config=model.tiling_config)
    images: list = [None] * len(rows)
    for place, index in enumerate(live):
        images[index] = ImageUtil.to_pil(decoded[place : place + 1])
    return images


def _encoded(model, prompt: str) -> tuple[mx.array, mx.array]:
    from mflux.models.flux2.model.flux2_text_encoder.prompt_encoder import Flux2PromptEncoder

    return Flux2PromptEncoder.encode_prompt(prompt=prompt, tokenizer=model.tokenizers["qwen3"],
                                            text_encoder=model.text_encoder, num_images_per_prompt=1,
                                            max_sequence_length=MAX_SEQUENCE_LENGTH,
                                            text_encoder_out_layers=TEXT_ENCODER_LAYERS)


def _stacked(pairs: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    return mx.concatenate([a for a, _ in pairs]), mx.concatenate([b for _, b in pairs])


def _predict(model, latents, latent_ids, embeds, text_ids, negative, guidance: float, timestep) -> mx.array:
    noise = model.transformer(hidden_states=latents, encoder_hidden_states=embeds, timestep=timestep,
                              img_ids=latent_ids, txt_ids=text_ids, guidance=None)
    if negative is None:
        return noise
    rows = latents.shape[0]
    negative_embeds, negative_ids = (mx.repeat(a, rows, axis=0) for a in negative)
    negative_noise = model.transformer(hidden_states=latents, encoder_hidden_states=negative_embeds,
                                       timestep=timestep, img_ids=latent_ids, txt_ids=negative_ids, guidance=None)
    return negative_noise + guidance * (noise - negative_noise)


def _stepped(row: BatchRow, done: int, total: int) -> bool:
    """Report the step to the row; False (the row leaves) if its callback raised."""
    if row.on_step is None:
        return True
    try:
        row.on_step(done, total)
    except Exception as exc:  # noqa: BLE001 — the row's own reason to stop (a client gone), handed back to it
        row.failure = exc
        return False
    return True


__all__ = ["BatchRow", "batch_key", "generate_batch"]

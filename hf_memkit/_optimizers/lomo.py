"""``optim`` values whose update runs inside backward: refused, with the reason.

hf_memkit's estimate counts the whole gradient of the trainable params alive from backward to
the optimizer step (kept across accumulation micro-steps); ``OptimizerMemory`` adds only the
optimizer's own state and step temporaries to that. These optimizers break that premise:

  * ``lomo`` / ``adalomo`` (package ``lomo-optim``, lomo_optim/lomo.py and adalomo.py): the
    Trainer passes the model itself (trainer_optimizer.py ``_get_lomo_optimizer``) and calls
    ``accelerator.backward(loss, learning_rate=...)``, which runs ``optimizer.fused_backward``:
    a hook on every param updates it from ``p.grad`` and sets ``p.grad = None`` during backward
    (``fuse_update``), so at most a few grads are ever alive, and AdaLomo keeps its factored
    second moments besides;
  * ``galore_*_layerwise`` / ``apollo_adamw_layerwise`` (trainer_optimizer.py
    ``_setup_low_rank_optimizer``): one optimizer per param, stepped and zeroed by a
    ``register_post_accumulate_grad_hook`` as soon as that param's grad is complete, so grads
    are freed one by one during backward, and each param's state is created there.
Modelling them needs a gradient term that the estimate does not have (grads freed inside
backward), so they are refused rather than over-predicted by the whole gradient.
"""

from __future__ import annotations

from .base import refuse

_IN_BACKWARD = ("its update runs inside backward ({how}), so gradients never all exist at "
                "once, and hf_memkit's estimate counts every gradient until the optimizer step")

refuse("lomo", _IN_BACKWARD.format(how="lomo_optim Lomo.fused_backward sets p.grad = None "
                                        "in a hook per param"))
refuse("adalomo", _IN_BACKWARD.format(how="lomo_optim AdaLomo.fused_backward sets p.grad = "
                                           "None in a hook per param"))
for _name in ("galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
              "galore_adafactor_layerwise", "apollo_adamw_layerwise"):
    refuse(_name, _IN_BACKWARD.format(
        how="transformers steps and zeroes one optimizer per param in a "
            "post-accumulate-grad hook") + f"; `{_name.removesuffix('_layerwise')}` is modelled")

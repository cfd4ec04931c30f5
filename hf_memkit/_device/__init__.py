"""Which device a run is planned for, and what that device measures.

* ``probe``: ``DeviceInfo``, ``probe_device`` (this machine: NVML, torch.cuda, MPS, CPU) and
  ``get_device`` / ``list_devices`` (the catalog);
* ``nvml``: which NVML device a CUDA device is, and what NVML says of its memory;
* ``catalog``: the bundled GPU catalog, one registered ``GpuSpec`` per card;
* ``precision``: what a device makes of the mixed precision asked for (one rule for estimates,
  plans and recipes);
* ``calibration``: a GPU's measured constants, stored per GPU / driver / torch / CUDA;
* ``measure``: measuring them on the GPU (``hf-memkit calibrate``);
* ``rss``: CPU memory readings from /proc (the CPU ground truth's window).

Why devices are matched as they are: docs/stack-facts.md (#nvml-and-cuda-device-numbering,
#bf16-and-tf32-flags, #cpu-ground-truth); a new GPU: docs/extending.md. Imports the ground
floor, ``_cuda`` (the constants a calibration replaces), ``_store`` (where calibrations are
kept) and ``_model`` (the model a calibration measures).
"""

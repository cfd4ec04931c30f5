"""Which device a run is planned for, and what that device measures.

* ``probe``: ``DeviceInfo``, ``probe_device`` (this machine: NVML, torch.cuda, MPS, CPU) and
  ``get_device`` / ``list_devices`` (the catalog);
* ``catalog``: the bundled GPU catalog, one registered ``GpuSpec`` per card;
* ``calibration``: a GPU's measured constants, stored per GPU / driver / torch / CUDA;
* ``measure``: measuring them on the GPU (``hf-memkit calibrate``);
* ``rss``: CPU memory readings from /proc (the CPU ground truth's window).

Imports the ground floor, and ``_cuda`` and ``_model`` where a calibration is measured.
"""

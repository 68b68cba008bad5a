"""GPU telemetry through NVML (``nvidia-ml-py``): memory, utilization, temperature per GPU.

On a machine without NVIDIA GPUs (no driver, no library) the answer is ``available: False`` with
the reason: no exception, no log noise. ``tide status`` shows it; the ingress exports it as
Prometheus gauges; the scaling policy can read utilization as load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gpu_telemetry"]


def gpu_telemetry() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "nvidia-ml-py is not installed", "gpus": []}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"no NVIDIA driver: {e}", "gpus": []}
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            gpus.append({
                "index": i,
                "name": pynvml.nvmlDeviceGetName(h),
                "memory_used_bytes": int(mem.used),
                "memory_total_bytes": int(mem.total),
                "utilization": util.gpu / 100.0,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            })
        return {"available": bool(gpus), "reason": "" if gpus else "no GPUs", "gpus": gpus}
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"NVML error: {e}", "gpus": []}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

"""The GPUs' published dense peak rates, for ``mfu_datasheet``: pure data, a source for each part.

``mfu`` divides the time a step's FLOPs need at the matmul rate ``stepprof calibrate`` measured
on this GPU; ``mfu_datasheet`` at the vendor's published peak for their dtype, as papers and
other tools (Megatron-LM, torchtitan) report MFU.  Their ratio is the share of the datasheet
peak that a large matmul reaches here.  A part's rates are dense tensor-core TFLOP/s by the
FLOP counter's dtype keys (``bf16``, ``fp16``, ``tf32``, ``fp32``, ``fp8``, ``fp64``): where a
datasheet prints a rate with 2:4 sparsity, the dense rate is half of it; ``fp32`` is the
non-tensor rate (fp32 matmuls run there unless TF32 is allowed, when the counter says ``tf32``).
A part is found by the name ``torch.cuda.get_device_name()`` gives.  No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

__all__ = ["PARTS", "Part", "datasheet_ms", "find_part"]


@attrs.frozen
class Part:
    """One GPU model's published dense peaks."""

    name: str
    #: What ``torch.cuda.get_device_name()`` says on it.
    device_names: tuple[str, ...]
    #: Dense TFLOP/s by the FLOP counter's dtype key.
    tflops: Mapping[str, float]
    #: Where the figures are published.
    source: str


def _rates(tf32: float | None, bf16: float | None, fp8: float | None, fp32: float | None,
           fp64: float | None) -> dict[str, float]:
    """Dense TFLOP/s by dtype key (fp16 at the bf16 rate, as every part here runs it)."""
    out = {"tf32": tf32, "bf16": bf16, "fp16": bf16, "fp8": fp8, "fp32": fp32, "fp64": fp64}
    return {k: v for k, v in out.items() if v is not None}


# NVIDIA's datasheets print the tensor rates with sparsity (``*``): these are half of them, or
# the dense figures where a whitepaper or datasheet prints them; fp64 is the FP64 Tensor Core rate.
# AMD's print dense rates; fp32 and fp64 are the matrix rates.  Checked 2026-12-07.
PARTS: Final[tuple[Part, ...]] = (
    Part("H100 SXM5", ("NVIDIA H100 80GB HBM3",), _rates(494.7, 989.4, 1978.9, 67, 67),
         "https://www.nvidia.com/en-us/data-center/h100/ (dense: H100 architecture whitepaper, Table 1)"),
    Part("H100 PCIe", ("NVIDIA H100 PCIe",), _rates(378, 756, 1513, 51, 51),
         "https://www.nvidia.com/en-us/data-center/h100/ (dense: H100 architecture whitepaper, Table 1)"),
    Part("H100 NVL", ("NVIDIA H100 NVL",), _rates(417.5, 835.5, 1670.5, 60, 60),
         "https://www.nvidia.com/en-us/data-center/h100/"),
    Part("H200 SXM", ("NVIDIA H200",), _rates(494.5, 989.5, 1979, 67, 67),
         "https://www.nvidia.com/en-us/data-center/h200/"),
    Part("H200 NVL", ("NVIDIA H200 NVL",), _rates(417.5, 835.5, 1670.5, 60, 60),
         "https://www.nvidia.com/en-us/data-center/h200/"),
    Part("A100", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB",
                  "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-80GB"), _rates(156, 312, None, 19.5, 19.5),
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    Part("L4", ("NVIDIA L4",), _rates(60, 121, 242.5, 30.3, None), "https://www.nvidia.com/en-us/data-center/l4/"),
    Part("L40S", ("NVIDIA L40S",), _rates(183, 362.05, 733, 91.6, None),
         "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    Part("A10", ("NVIDIA A10",), _rates(62.5, 125, None, 31.2, None),
         "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"),
    Part("B200 (HGX)", ("NVIDIA B200",), _rates(1100, 2250, 4500, 75, 37),
         "https://www.nvidia.com/en-us/data-center/hgx/ (Individual Blackwell GPU Specifications, HGX B200)"),
    Part("GeForce RTX 4090", ("NVIDIA GeForce RTX 4090",), _rates(82.6, 165.2, 330.3, 82.6, None),
         "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf "
         "(Appendix A, Table 2: FP32 accumulate, as torch's matmuls)"),
    Part("Instinct MI300X", ("AMD Instinct MI300X", "AMD Instinct MI300X VF"), _rates(653.7, 1307.4, 2614.9, 163.4, 163.4),
         "https://rocm.docs.amd.com/en/latest/conceptual/gpu-arch/mi300.html"),
    Part("Instinct MI325X", ("AMD Instinct MI325X",), _rates(653.7, 1307.4, 2614.9, 163.4, 163.4),
         "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"),
    # torch sees each of an MI250X's two dies (GCDs) as a device: half the package's rates.
    Part("Instinct MI250X (one GCD)", ("AMD Instinct MI250X", "AMD Instinct MI250X/MI250"),
         _rates(None, 191.5, None, 47.85, 47.85),
         "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html (the package's rates, halved)"),
    Part("Instinct MI210", ("AMD Instinct MI210",), _rates(None, 181, None, 45.3, 45.3),
         "https://www.amd.com/en/products/accelerators/instinct/mi200/mi210.html"),
)


def _key(name: str) -> str:
    return " ".join(name.lower().split())


_BY_NAME: Final = {_key(n): p for p in PARTS for n in p.device_names}


def find_part(device_name: str) -> tuple[Part | None, str | None]:
    """(the part named ``device_name``, None), or (None, why it has no datasheet peak here)."""
    part = _BY_NAME.get(_key(device_name))
    if part is not None:
        return part, None
    return None, (f"{device_name} is not in stepprof's datasheet table ({', '.join(p.name for p in PARTS)}); "
                  f"mfu (against this GPU's measured rate, `stepprof calibrate`) still applies")


def datasheet_ms(flops_by_dtype: Mapping[str, float], part: Part) -> tuple[float | None, str | None]:
    """The time ``flops_by_dtype`` needs at ``part``'s dense peaks, in ms; or (None, why)."""
    total = 0.0
    for key, n in flops_by_dtype.items():
        if not n:
            continue
        peak = part.tflops.get(key)
        if peak is None:
            return None, (f"the step does {key} FLOPs, and the {part.name}'s datasheet gives no dense "
                          f"{key} rate (it gives {', '.join(sorted(part.tflops))})")
        total += n / (peak * 1e12) * 1e3
    return total, None

"""GPU instance types the eks target knows: what one node offers a training pod.

Requests leave headroom for the kubelet, the system pods and the device plugins (DaemonSets).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    efa: int  # EFA interfaces (vpc.amazonaws.com/efa); 0: no EFA
    vcpus: int
    memory_gib: int
    float8: bool = False  # float8 tensor cores: compute capability >= 8.9 (L4, H100, H200)

    @property
    def cpu_request(self) -> int:
        return max(1, self.vcpus * 9 // 10 - 2)

    @property
    def memory_request_gib(self) -> int:
        return max(1, self.memory_gib * 85 // 100 - 8)

    @property
    def shm_gib(self) -> int:
        """/dev/shm for NCCL and data-loader workers: an eighth of the memory, at most 256 GiB."""
        return max(1, min(256, self.memory_gib // 8))


INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in (
    InstanceType("g5.12xlarge", gpus=4, efa=0, vcpus=48, memory_gib=192),
    InstanceType("g5.48xlarge", gpus=8, efa=1, vcpus=192, memory_gib=768),
    InstanceType("g6.12xlarge", gpus=4, efa=0, vcpus=48, memory_gib=192, float8=True),
    InstanceType("g6.48xlarge", gpus=8, efa=1, vcpus=192, memory_gib=768, float8=True),
    InstanceType("p4d.24xlarge", gpus=8, efa=4, vcpus=96, memory_gib=1152),
    InstanceType("p4de.24xlarge", gpus=8, efa=4, vcpus=96, memory_gib=1152),
    InstanceType("p5.48xlarge", gpus=8, efa=32, vcpus=192, memory_gib=2048, float8=True),
    InstanceType("p5e.48xlarge", gpus=8, efa=32, vcpus=192, memory_gib=2048, float8=True),
    InstanceType("p5en.48xlarge", gpus=8, efa=16, vcpus=192, memory_gib=2048, float8=True),
)}

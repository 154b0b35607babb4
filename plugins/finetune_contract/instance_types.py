"""Instance profiles: one checked entry per GPU instance type the eks target supports, the single
source for what a node offers (GPUs, EFA devices, CPU and memory a pod can have), the NCCL/EFA
environment of its pods, and the all-reduce bus bandwidth its preflight compares against.

Sources (each figure below names which):
- [EC2]   AWS, "Amazon EC2 instance types - Accelerated computing" specifications: GPUs, GPU
          memory, vCPUs, memory, network bandwidth, NVLink/NVSwitch.
- [EFA]   AWS, "Elastic Fabric Adapter" user guide: supported instance types, the number of EFA
          interfaces (network cards), and "RDMA read is supported on all instances with Nitro
          version 4 and later" (p4d/p4de: RDMA read is what GPUDirect RDMA over EFA started with).
- [EKSCTL] eksctl's instance table (pkg/utils/instance/instance_types.go): EFASupported is true
          for g5.12xlarge, g5.24xlarge, g5.48xlarge, g6.12xlarge, g6.24xlarge, g6.48xlarge, p4d,
          p4de, p5, p5e and p5en.
- [AMI]   The EKS-optimized AMI's kubelet reservations: kube-reserved memory 255 MiB + 11 MiB
          per pod (max pods of the type), kube-reserved CPU 6% of the first core, 1% of the
          second, 0.5% of the next two, 0.25% of the rest; eviction at 100 MiB free.
- [NCCL]  NVIDIA's NCCL docs and nccl-tests (busbw = algbw x 2(n-1)/n for all-reduce), NVIDIA's
          published DGX A100 / DGX H100 all_reduce_perf figures (about 230 GB/s on 8 A100 over
          NVLink 3, about 480 GB/s on 8 H100/H200 over NVLink 4, large messages, NVLS off).
- [LINE]  No published all-reduce figure found here: the expectation is 80% of the link's line
          rate (PCIe Gen4 x16 about 25 GB/s a direction; EFA's aggregate network bandwidth of the
          type). A preflight fails a node only well below it (`BUSBW_FLOOR`), so an estimate
          this rough still tells a working fabric from a broken one (TCP instead of EFA is about
          ten times slower; PCIe instead of NVLink about ten times).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# A node whose measured bus bandwidth is below this fraction of its profile's figure fails the
# preflight: the figures are large-message nccl-tests results (or line-rate estimates), the
# preflight's all-reduce is shorter, so the margin is wide on purpose.
BUSBW_FLOOR = 0.5

# What the DaemonSets on every GPU node take (VPC CNI, kube-proxy, the NVIDIA and EFA device
# plugins, DCGM exporter, node exporter, a CSI node driver): a generous sum of their requests.
DAEMONSET_CPU_M = 2000
DAEMONSET_MEMORY_MIB = 8 * 1024
# Max pods per node for the kubelet's memory reservation [AMI]: the largest of the AMI's
# ENI-based table among these types (737); a type with fewer reserves less, so the requests fit
# whatever its value is (not checked per type here).
MAX_PODS = 737
# The kernel and firmware keep some memory: the node's capacity is below the nominal GiB.
OS_MEMORY_FRACTION = 0.97
# The EFA installer on the EKS AMI reserves 2 MiB huge pages for libfabric's buffers; AWS's EFA
# examples request 5120 MiB of them per pod (a pod without them falls back to regular pages).
EFA_HUGEPAGES_MIB = 5120


@dataclass(frozen=True)
class InstanceProfile:
    name: str
    gpus: int
    gpu_model: str
    gpu_memory_gib: int
    vcpus: int
    memory_gib: int
    efa: int  # EFA devices the device plugin advertises (vpc.amazonaws.com/efa); 0: no EFA
    efa_rdma_read: bool  # GPUDirect RDMA read over EFA [EFA]
    nvswitch: bool  # all GPUs on one NVLink switch fabric (else PCIe between GPUs)
    nvls: bool  # NVLink SHARP (NVSwitch gen 3, H100/H200): NCCL's NVLS all-reduce in a node
    busbw_intra_gbps: float  # expected NCCL all-reduce bus bandwidth in a node, GB/s
    busbw_inter_gbps: float  # across nodes (EFA), GB/s
    busbw_source: str  # where the two figures come from (see the module docstring)
    capability: tuple[int, int]  # the GPUs' CUDA compute capability (NVIDIA's CUDA GPU list)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def kube_reserved_cpu_m(self) -> int:
        """[AMI] millicores the kubelet and system keep."""
        cores = [60, 10, 5, 5] + [2.5] * max(0, self.vcpus - 4)
        return int(sum(cores[: self.vcpus]))

    @property
    def kube_reserved_memory_mib(self) -> int:
        """[AMI] MiB the kubelet keeps, with the eviction threshold."""
        return 255 + 11 * MAX_PODS + 100

    @property
    def allocatable_cpu_m(self) -> int:
        return self.vcpus * 1000 - self.kube_reserved_cpu_m

    @property
    def allocatable_memory_mib(self) -> int:
        return int(self.memory_gib * 1024 * OS_MEMORY_FRACTION) - self.kube_reserved_memory_mib

    @property
    def cpu_request(self) -> int:
        """Whole cores a training pod requests: allocatable less the DaemonSets."""
        return max(1, (self.allocatable_cpu_m - DAEMONSET_CPU_M) // 1000)

    @property
    def memory_request_gib(self) -> int:
        """GiB a training pod requests: allocatable less the DaemonSets and the huge pages."""
        spare = self.allocatable_memory_mib - DAEMONSET_MEMORY_MIB - self.hugepages_mib
        return max(1, spare // 1024)

    @property
    def hugepages_mib(self) -> int:
        return EFA_HUGEPAGES_MIB if self.efa else 0

    @property
    def shm_gib(self) -> int:
        """/dev/shm for NCCL and data-loader workers: an eighth of the memory, at most 256 GiB."""
        return max(1, min(256, self.memory_gib // 8))

    @property
    def nccl_env(self) -> dict[str, str]:
        """The NCCL/libfabric environment of this type's training pods."""
        env: dict[str, str] = {}
        if self.efa:
            env["FI_PROVIDER"] = "efa"
            # Pages registered with the device stay valid in a forked data-loader worker.
            env["FI_EFA_FORK_SAFE"] = "1"
            if self.efa_rdma_read:
                # Only where the device has RDMA read: recent libfabric aborts otherwise; where it
                # is unset, libfabric decides from the device.
                env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        # NVLS is left to NCCL: it turns it on where the NVSwitch has it (p5 class). NCCL_PROTO
        # too: forcing Simple was advice for early aws-ofi-nccl plugins, which now tune it.
        env.update(self.extra_env)
        return env

    def resources(self, gpus: int) -> dict[str, dict[str, Any]]:
        """A training pod's requests and limits on this type with `gpus` GPUs: all its EFA
        devices, CPU and memory less what the node keeps, huge pages where EFA wants them
        (requests equal to limits, as Kubernetes requires of devices and huge pages)."""
        fixed: dict[str, Any] = {GPU_RESOURCE: gpus}
        if self.efa:
            fixed[EFA_RESOURCE] = self.efa
        if self.hugepages_mib:
            fixed["hugepages-2Mi"] = f"{self.hugepages_mib}Mi"
        return {"requests": {"cpu": str(self.cpu_request),
                             "memory": f"{self.memory_request_gib}Gi", **fixed},
                "limits": dict(fixed)}


def _pcie(name: str, gpus: int, model: str, vcpus: int, memory_gib: int,
          network_gbps: int, capability: tuple[int, int]) -> InstanceProfile:
    """g5/g6: GPUs on PCIe Gen4 (no NVLink), one EFA device, no RDMA read a source we could
    check claims (g5 is Nitro v3; g6 left unset too, so libfabric decides). [EC2] [EKSCTL]"""
    return InstanceProfile(
        name, gpus=gpus, gpu_model=model, gpu_memory_gib=24, vcpus=vcpus, memory_gib=memory_gib,
        efa=1, efa_rdma_read=False, nvswitch=False, nvls=False, capability=capability,
        busbw_intra_gbps=0.8 * 25 * 0.6,  # [LINE] a ring through the host's PCIe switches
        busbw_inter_gbps=0.8 * network_gbps / 8, busbw_source="LINE")


def _sxm(name: str, model: str, gpu_memory_gib: int, vcpus: int, memory_gib: int, efa: int,
         network_gbps: int, nvlink4: bool) -> InstanceProfile:
    """p4d/p4de (8 A100, NVLink 3) and the p5 class (8 H100/H200, NVLink 4 with NVLS): GPUs on
    one NVSwitch fabric, EFA with RDMA read. [EC2] [EFA]; intra [NCCL], inter [LINE]."""
    return InstanceProfile(
        name, gpus=8, gpu_model=model, gpu_memory_gib=gpu_memory_gib, vcpus=vcpus,
        memory_gib=memory_gib, efa=efa, efa_rdma_read=True, nvswitch=True, nvls=nvlink4,
        capability=(9, 0) if nvlink4 else (8, 0), busbw_intra_gbps=480.0 if nvlink4 else 230.0,
        busbw_inter_gbps=0.8 * network_gbps / 8, busbw_source="NCCL (intra), LINE (inter)")


INSTANCE_TYPES: dict[str, InstanceProfile] = {p.name: p for p in (
    _pcie("g5.12xlarge", 4, "NVIDIA A10G", 48, 192, network_gbps=40, capability=(8, 6)),
    # The same 4 GPUs with twice the CPU and memory: a spot node group's second type.
    _pcie("g5.24xlarge", 4, "NVIDIA A10G", 96, 384, network_gbps=50, capability=(8, 6)),
    _pcie("g5.48xlarge", 8, "NVIDIA A10G", 192, 768, network_gbps=100,
          capability=(8, 6)),
    _pcie("g6.12xlarge", 4, "NVIDIA L4", 48, 192, network_gbps=40, capability=(8, 9)),
    _pcie("g6.24xlarge", 4, "NVIDIA L4", 96, 384, network_gbps=50, capability=(8, 9)),
    _pcie("g6.48xlarge", 8, "NVIDIA L4", 192, 768, network_gbps=100,
          capability=(8, 9)),
    _sxm("p4d.24xlarge", "NVIDIA A100-SXM4-40GB", 40, 96, 1152, efa=4, network_gbps=400,
         nvlink4=False),
    _sxm("p4de.24xlarge", "NVIDIA A100-SXM4-80GB", 80, 96, 1152, efa=4, network_gbps=400,
         nvlink4=False),
    _sxm("p5.48xlarge", "NVIDIA H100 80GB HBM3", 80, 192, 2048, efa=32, network_gbps=3200,
         nvlink4=True),
    _sxm("p5e.48xlarge", "NVIDIA H200", 141, 192, 2048, efa=32, network_gbps=3200,
         nvlink4=True),
    # p5en: 16 EFAv3 devices for the same 3200 Gbps.
    _sxm("p5en.48xlarge", "NVIDIA H200", 141, 192, 2048, efa=16, network_gbps=3200,
         nvlink4=True),
)}


def holds(node_type: str, pod_type: str) -> bool:
    """Whether a node of `node_type` holds a training pod made for `pod_type`: the same GPU
    model and count, and at least the CPU, memory (with the huge pages) and EFA devices the pod
    requests."""
    node, pod = INSTANCE_TYPES[node_type], INSTANCE_TYPES[pod_type]
    return (node.gpu_model, node.gpus) == (pod.gpu_model, pod.gpus) \
        and node.allocatable_cpu_m >= pod.cpu_request * 1000 + DAEMONSET_CPU_M \
        and node.allocatable_memory_mib >= pod.memory_request_gib * 1024 + pod.hugepages_mib \
        + DAEMONSET_MEMORY_MIB and node.efa >= pod.efa


def gpu_class(pod_type: str) -> tuple[str, ...]:
    """The instance types a training pod made for `pod_type` may run on (`holds`), itself
    first: a node group of several types (spot's usual several pools) must be of these, with
    `pod_type` the smallest."""
    return (pod_type, *(name for name in INSTANCE_TYPES
                        if name != pod_type and holds(name, pod_type)))

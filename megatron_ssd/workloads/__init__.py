"""CPU reference workloads on megatron-core: small GPT / BERT / T5 models built for CPU
(:mod:`.models`), torch.distributed and Megatron's model parallelism set up without
Megatron-LM (:mod:`.parallel`), a function run in several local processes that form one
process group (:mod:`.spawn`), seeded synthetic and text-file data, and the training step
loop over megatron-core's schedules (:mod:`.harness`).

``megatron-ssd train`` / ``plan`` / ``rok``, the benchmarks and the tests run on these.
Using megatron-ssd inside Megatron-LM needs none of it (:mod:`megatron_ssd.megatron`).
"""

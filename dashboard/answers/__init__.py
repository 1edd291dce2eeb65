"""The article's five self-test questions (§九 自测), answered from a recorded run.

Each module computes one answer from the run store (through dashboard/answers/source.py,
which reads only through vllm_anatomy/tracing/reader.py) and returns an Answer
(dashboard/answers/common.py): the run's own values, a "show me" deep link to the
step, tab and request where it happens, and — when the run cannot answer (no request
finished, no allocation recorded) — a plain sentence saying why. Nothing here is
written by hand but the questions and the article's reference answers.

    q1_allocation     Scheduler.schedule() → a KV block allocated
    q2_update_states  what GPUModelRunner._update_states did in one step
    q3_block_table    the block table as the attention kernel receives it
    q4_finish         a request finishes: Scheduler, KVCacheManager.free, reuse
    q5_accounts       the five accounts of one request (also on the Request journey page)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    key: str
    zh: str              # the article's words
    en: str              # one English line
    reference_zh: str    # the article's reference answer (答案)
    reference_en: str


QUESTIONS = [
    Question("q1", "从 Scheduler.schedule() 到 KV 块被分配，经过哪几个对象与方法？",
             "From Scheduler.schedule() to a KV block being allocated: which objects and methods does it pass through?",
             "Scheduler.schedule → KVCacheManager.get_computed_blocks（查 prefix cache 命中的块）→ "
             "KVCacheManager.allocate_slots（算需要几个新块）→ BlockPool.get_new_blocks（从空闲队列取、可能先驱逐带哈希的旧块）"
             "→ 追加到请求的 block table；结果写进 SchedulerOutput.new_block_ids。",
             "schedule → get_computed_blocks (prefix-cache hits) → allocate_slots (how many new blocks) → "
             "BlockPool.get_new_blocks (from the free queue, evicting a hashed block first if needed) → appended to "
             "the request's block table; the result goes into SchedulerOutput's new block ids."),
    Question("q2", "GPUModelRunner._update_states 做什么？为什么它是 InputBatch 持久化的关键？",
             "What does GPUModelRunner._update_states do, and why is it the key to the persistent InputBatch?",
             "按 SchedulerOutput 把完成 / 抢占的请求从 InputBatch 移除（尾部行填补空位）、新请求加入、更新每个请求的 "
             "num_computed_tokens 与 block table；InputBatch 跨步保留，所以每步只做增量更新而不是重建，"
             "LogitsProcessor 的状态也随之同步。",
             "It removes finished / preempted requests from the InputBatch (tail rows fill the holes), adds new ones, "
             "updates each request's num_computed_tokens and block table; the batch persists across steps, so each "
             "step is an incremental update, not a rebuild."),
    Question("q3", "block table 是怎么进到 attention kernel 的？decode 时 kernel 用它做什么？",
             "How does the block table get into the attention kernel, and what does the kernel do with it during decode?",
             "_prepare_inputs 把每个请求的物理块号写进 block_table 张量、算出 slot_mapping（新 token 写到哪个 slot）、"
             "seq_lens，打包成 attention metadata；decode kernel 对每个请求按 block table 查 KV 块地址，逐块读 K、V 做 "
             "attention，新 K、V 按 slot_mapping 写入。",
             "_prepare_inputs writes each request's physical block ids into the block_table tensor, computes "
             "slot_mapping (where each new token goes) and seq_lens, and packs them into the attention metadata; the "
             "decode kernel looks up each request's blocks in its row, reads K and V block by block, and the new K/V "
             "is written at slot_mapping."),
    Question("q4", "一个请求完成时 Scheduler 与 KVCacheManager 各做什么？块立刻能被别的请求用吗？",
             "When a request finishes, what do the Scheduler and the KVCacheManager each do? Can its blocks be used "
             "by another request right away?",
             "Scheduler 把请求移出 running、标记 finished、生成输出；KVCacheManager.free 把请求的块 ref_cnt -= 1，"
             "为 0 的块进空闲队列尾部并保留哈希——能被新请求作为空闲块取用，也可能先被 prefix cache 命中复用；"
             "共享块要等所有引用者完成。",
             "The Scheduler takes it out of running, marks it finished and emits its output; KVCacheManager.free "
             "drops each block's ref_cnt by one, blocks at 0 join the free queue's tail keeping their hash — a new "
             "request can take them as free blocks, or hit them in the prefix cache first; shared blocks wait for "
             "every holder."),
    Question("q5", "同一个请求的“五笔账”各是什么？为什么说没有一个数字能单独说明问题？",
             "What are the \"five accounts\" of one request, and why can no single number tell the story alone?",
             "时间账（prefill 92 ms / decode 3000 ms）、显存账（KV 734 MB vs 权重 17.5 GB / 卡）、通信账（每步 160 次 "
             "all-reduce）、CPU 账（调度与元数据准备）、请求账（状态迁移与对象）。优化一笔常动另一笔——大 batch 省时间账但"
             "涨显存账、投机解码省轮次但涨每步时间——合起来才是系统。",
             "Time (prefill 92 ms / decode 3000 ms), memory (KV 734 MB vs 17.5 GB of weights per GPU), communication "
             "(160 all-reduces per step), CPU (scheduling and metadata preparation), request (state transitions and "
             "objects). Improving one account often moves another — only together are they the system."),
]
BY_KEY = {q.key: q for q in QUESTIONS}

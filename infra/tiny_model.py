"""01 --build-base: a tiny model built offline, a byte-level BPE tokenizer and a small Llama (build_tiny_base: the
tests' and benches' models), and the demo's base model, the one that plays the pretrained LLM (build_demo_base),
pretrained on the demo world's posts (tasks/demo.py). Saved whole or not at all (infra.runs.save_pretrained).
"""

from __future__ import annotations

from common import format_rm_target, rm_user_message
from infra.runs import save_pretrained
from tasks.demo import demo_critic, demo_dataset


def build_demo_base(out_dir, pretrain_steps: int = 250, n_texts: int = 3000, seed: int = 0, pets: int = 1) -> str:
    """The demo's stand-in for a pretrained LLM: a tokenizer and a 2-layer, 0.6M-parameter Llama trained to continue
    demo posts with their correct summary (loss on the summary only). That gives it the skill a real LLM brings,
    copying facts from its context (an induction-head skill a model this small needs a few hundred focused steps for;
    plain LM loss over whole posts, or a 4-layer model, takes far longer). It never sees critiques or reward-model
    prompts (stage 2 teaches those) nor the noisy SFT targets (stage 3), only their words in the tokenizer corpus."""
    texts, pretrain = [], []
    for ex in demo_dataset("pretrain", n_texts, pets=pets):
        critique = " " + format_rm_target(**demo_critic(ex["prompt"], ex["response"]))
        pretrain.append((ex["prompt"], " " + ex["reference"]))
        texts += [ex["prompt"] + ex["response"], critique]
    texts += [rm_user_message("", "") + "\n\n### Critique\n"] * 100  # so the RM instruction's words are single tokens
    return build_tiny_base(
        out_dir, texts, num_layers=2, pretrain_texts=pretrain, pretrain_steps=pretrain_steps, lr=2e-3, seed=seed
    )


def build_tiny_base(
    out_dir,
    texts: list[str],
    vocab_size: int = 1000,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    chat_template: str | None = None,
    pretrain_texts: list | None = None,
    pretrain_steps: int = 0,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
) -> str:
    """Train a byte-level BPE tokenizer on `texts`, build a small Llama from a config, optionally pretrain it so it
    plays the role of a pretrained LLM, and save both to `out_dir` for from_pretrained. `pretrain_texts` (default
    `texts`) holds strings (loss on every token) or (context, continuation) pairs (loss on the continuation and EOS).
    Every word of a small regular corpus becomes one token (~600-700 in all)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        tok.chat_template = chat_template
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    if pretrain_steps:
        from tqdm.auto import tqdm

        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30))  # short warm-up
        examples = []  # (ids, index of the first token with a loss)
        for t in pretrain_texts or texts:
            context, cont = t if isinstance(t, tuple) else ("", t)
            ids = tok(context, add_special_tokens=False)["input_ids"] if context else []
            examples.append((ids + tok(cont, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], len(ids)))
        gen = torch.Generator().manual_seed(seed)
        for _ in tqdm(range(pretrain_steps), desc="pretrain tiny base", leave=False):
            batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=gen).tolist()]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            labels = ids.clone()
            for row, (seq, first) in enumerate(batch):
                labels[row, :first] = -100
                labels[row, len(seq) :] = -100
            loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    model.generation_config.pad_token_id = tok.pad_token_id
    return str(save_pretrained(out_dir, model, tok))

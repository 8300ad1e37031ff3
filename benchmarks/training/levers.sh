#!/usr/bin/env bash
# Issue 37's levers, each at equal steps on the new data (all the shipped 10k answers), and the long runs
# (recipes/smollm2/*_long.yaml), planned for 2.5 h of wall time on 2 cores. Every stage is resumable: run the same
# command again after an interruption and nothing finished is redone (prepare resumes from its index, training from
# its newest checkpoint with train.resume_from=latest, exactly; a finished run or evaluation is skipped).
#
#   bash benchmarks/training/levers.sh plan              # the variants and their overrides
#   bash benchmarks/training/levers.sh levers [GROUP..]  # cache, every lever (or the groups eagle3 dflash dspark mtp
#                                                        # mix, or levers by name), each one's held-out tau, then
#                                                        # the report
#   bash benchmarks/training/levers.sh long KIND [k=v..] # recipes/smollm2/KIND_long.yaml, then its held-out tau
#   bash benchmarks/training/levers.sh full KIND [k=v..] # the same training, then long_eval.sh and long_curves.py
#                                                        # (one working stretch: ~90 + ~55 + ~10 min)
#   bash benchmarks/training/levers.sh fr KIND N         # KIND's long drafter with a frequency-ranked head of N
#                                                        # tokens (export --draft-vocab-size) beside its full head,
#                                                        # interleaved: held-out 32 and MT-Bench 16 (~40 min)
#   bash benchmarks/training/levers.sh report            # levers_screen.json / .md from what has finished
#   bash benchmarks/training/levers.sh curves            # tau vs CPU time of the DFlash / DSpark layer variants
#   bash benchmarks/training/levers.sh smoke [LEVER..]   # 2 steps of each lever on 8 conversations, online features,
#                                                        # and the shared cache read by a 5-tap and an MTP lever
#
# ---- What the features cost (draftsmith estimate RECIPE [--no-probe], OMP_NUM_THREADS=1, on the shared 2-core
# development machine beside other work, load 1.5-2.9; the quiet session has 2 threads to itself) ----
#   data (num_samples: null): 8,100 training + 26 eval conversations, 2,514,486 tokens (held-out 256 excluded)
#   cache disk (bf16): layers [2, 9, 15, 21, 27] + final 6,920 B/token = 16.2 GiB; EAGLE-3's [2, 15, 27] 10.8 GiB;
#     MTP's final norm only 2.7 GiB
#   HF feature throughput, batch 4: 136-205 tokens/s at 1 thread here (3.4-5.1 h for the set); docs/benchmarks.md's
#     HF trial at 2 quiet threads, 1.78 samples/s = ~550 tokens/s: 76 min for the set, 2.24 s per step of 4 (~1,230
#     tokens). Quiet-session numbers below = the ones measured here / 3.2 (550 / 170; DSpark's documented 2.9 s a
#     step against 9.5 s here agrees).
#   probe, online, 1 thread here (s/step; the target forward ~7 s of it): EAGLE-3 TTT 3 13.1, DFlash 10.4, DSpark
#     16.7, MTP-3 full vocab 28.3, MTP-3 8k vocab 12.7. Drafter alone at 2 quiet threads (s/step): EAGLE-3 1.2 (TTT 1
#     to 70%, then 3; 1.85 with TTT 3 throughout), DFlash 1.0, DSpark 2.9, MTP-3 8k 1.7 (full vocab 3.1, documented).
#   One epoch (2,025 steps), minutes:      offline (extract + train)  online (forward in the step)  streamed (*)
#     EAGLE-3                                     76 + 41 = 117              116                        126
#     DFlash                                      76 + 34 = 110              109                        126
#     DSpark                                      76 + 98 = 174              173                        161
#     MTP-3, 8k draft vocab                       76 + 57 = 133              133                        126
#   (*) producer and trainer at 1 thread each, beside each other, if two 1-thread processes do 1.65x one 2-thread
#       process: the producer needs 126 min for the set, so it bounds the wall time.
# Choice, long runs: online for all four. One pass reads each sample once, so a cache only adds 11-16 GiB and a stage;
#   streamed would buy at most ~7% more steps, and only if the thread-scaling assumption holds. Plan per run: training
#   (probes included) + long_eval.sh (~55 min: held-out, MT-Bench, per category) + long_curves inside one working
#   stretch of 3 h. EAGLE-3 ran its epoch (7,391 s with its probes on the Intel Xeon with AMX, 2 threads: 4.11
#   CPU-hours, over the issue's 3, and too long to leave time for its MT-Bench pass); DFlash, DSpark and MTP-3 stop at
#   train.max_time_minutes: 90 (3 CPU-hours at 2 threads) where the epoch is longer (DFlash ~109, MTP-3 ~133, DSpark
#   ~173 min), the cosine annealed to the budget (schedule.anneal_on: time).
# Choice, levers: offline, one cache of the first STEPS x 4 training conversations (the layers [2, 9, 15, 21, 27]
#   every lever reads at most, + final norm: ~7 min, 1.5 GiB at 180 steps), read by all 19 variants; online would
#   repeat the target forward 19 times. At STEPS=180: ~108 min of training (the s/step above, per variant) + ~19 min
#   of held-out tau (16 questions) + ~10 min of loading = ~145 min. GROUPS run alone take ~40 (eagle3), ~25 (dflash),
#   ~50 (dspark), ~35 (mtp) min; STEPS scales the training part. The mix group (not in that sum) regenerates 110
#   answers to ShareGPT code prompts and 110 to GSM8K train questions with HF generate (~15 min), trains its two
#   levers online (~13 min each at 2 quiet threads: the mixed split is not the cache's) and decodes the held-out
#   slice, HumanEval and GSM8K first turns with each (~10 min): ~50 min.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/training/eval_passes.sh  # has FILE DATASET: that eval pass is in the file
export HF_HUB_OFFLINE=1
RUNS=${RUNS:-runs/levers}
STEPS=${STEPS:-180}
THREADS=${THREADS:-2}
HELD=recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl
ALL_GROUPS="eagle3 dflash dspark mtp mix"
MIX=${MIX:-$RUNS/mix}  # the data-mix lever's answered prompts (mix_data)
NO_MIX="data.mix=[]"  # the screen compares levers on ShareGPT alone: the recipes' math mix left out (the mix lever
                      # sets its own data.mix after it)
LEVERS_eagle3="eagle3_base eagle3_ttt_start eagle3_ttt_03 eagle3_taps5 eagle3_lk eagle3_lk_hybrid
               eagle3_warm_layer eagle3_fc_identity"
LEVERS_dflash="dflash_base dflash_2layers dflash_3layers dflash_auf dflash_dpace dflash_vocab8k"
LEVERS_dspark="dspark_base dspark_2layers dspark_3layers dspark_auf"
LEVERS_mtp="mtp_vocab8k mtp_vocab16k mtp_full_vocab mtp_vocab8k_lk"
LEVERS_mix="mix_base mix_code_math"

variant() {  # lever name -> KIND (its long recipe), K (drafts a round when evaluated), OVERRIDES (array)
  OVERRIDES=()
  case "$1" in
    eagle3_base) KIND=eagle3 ;;  # the recipe as it is (5 taps, TTT 3 from the start since the 2026-12-05 screen)
    eagle3_ttt_start) KIND=eagle3; OVERRIDES=("train.phases=[]") ;;
    eagle3_ttt_03) KIND=eagle3; OVERRIDES=("train.phases=[{until_fraction: 0.3, drafter: {ttt_steps: 1}}]") ;;
    eagle3_taps5) KIND=eagle3; OVERRIDES=("drafter.layer_ids=[2, 9, 15, 21, 27]") ;;
    eagle3_lk) KIND=eagle3; OVERRIDES=("drafter.loss=lk") ;;
    eagle3_lk_hybrid) KIND=eagle3; OVERRIDES=("drafter.loss=lk_hybrid") ;;
    eagle3_warm_layer) KIND=eagle3; OVERRIDES=("drafter.init_layer_from_target=29") ;;  # the target's last layer
    eagle3_fc_identity) KIND=eagle3; OVERRIDES=("drafter.fc_init=identity_high") ;;  # fc starts as the top tap
    dflash_base) KIND=dflash ;;  # 1 draft layer, decay weights
    dflash_2layers) KIND=dflash; OVERRIDES=("drafter.num_layers=2") ;;
    dflash_3layers) KIND=dflash; OVERRIDES=("drafter.num_layers=3") ;;
    dflash_auf) KIND=dflash; OVERRIDES=("drafter.loss_weighting=auf") ;;
    dflash_dpace) KIND=dflash; OVERRIDES=("drafter.loss_weighting=dpace") ;;
    # a trained 8,192-row head (MTP's, EAGLE-3's) for the target's frozen 49,152 rows, which cost most of a DFlash
    # round's drafting here (d(k) 0.22-0.28 decode steps on the Xeon, long_dflash_eval.md)
    dflash_vocab8k) KIND=dflash; OVERRIDES=("drafter.draft_vocab_size=8192") ;;
    dspark_base) KIND=dspark ;;
    dspark_2layers) KIND=dspark; OVERRIDES=("drafter.num_layers=2") ;;
    dspark_3layers) KIND=dspark; OVERRIDES=("drafter.num_layers=3") ;;
    dspark_auf) KIND=dspark; OVERRIDES=("drafter.loss_weighting=auf") ;;
    mtp_vocab8k) KIND=mtp ;;  # the recipe: an 8,192-row draft-vocabulary head, soft CE
    mtp_vocab16k) KIND=mtp; OVERRIDES=("drafter.draft_vocab_size=16384") ;;
    mtp_full_vocab) KIND=mtp; OVERRIDES=("drafter.draft_vocab_size=null") ;;  # the target's frozen 49,152-row head
    mtp_vocab8k_lk) KIND=mtp; OVERRIDES=("drafter.loss=lk") ;;
    # the data mix, at equal steps and online features (the mixed split is not the shared cache's): 720 ShareGPT
    # answers, against 540 of them + 90 answers to ShareGPT code prompts + 90 to GSM8K train questions (mix_data)
    mix_base) KIND=eagle3; OVERRIDES=("features.mode=online") ;;
    mix_code_math) KIND=eagle3; local take=${MIX_TAKE:-$((STEPS / 2))}  # STEPS x 4 conversations in all
      OVERRIDES=("features.mode=online" "data.num_samples=$((STEPS * 4 - 2 * take))"
      "data.mix=[{path: $MIX/sharegpt_code.jsonl, num_samples: $take}, {path: $MIX/gsm8k.jsonl, num_samples: $take}]") ;;
    *) echo "levers.sh: unknown lever '$1' (bash benchmarks/training/levers.sh plan lists them)" >&2; exit 2 ;;
  esac
  case "$KIND" in eagle3 | mtp) K=3 ;; *) K=7 ;; esac
}

levers_of() {  # the levers of the named groups (every group by default); a lever's own name stands for itself
  local group names=""
  for group in ${*:-$ALL_GROUPS}; do
    case " $ALL_GROUPS " in
      *" $group "*) ;;
      *) if (variant "$group") > /dev/null 2>&1; then names="$names $group"; continue; fi
         echo "levers.sh: unknown group or lever '$group' (groups: $ALL_GROUPS; levers: levers.sh plan)" >&2; exit 2 ;;
    esac
    local list="LEVERS_$group"
    names="$names ${!list}"
  done
  echo $names
}

heldout() {  # $1 = drafter dir, $2 = k, $3 = JSON out [, $4 = prompt set]: tau on 16 first turns x 64 tokens of the
  # held-out slice (or of the set named; skipped if done)
  [ -f "$3" ] && return 0
  OMP_NUM_THREADS=$THREADS python benchmarks/training/heldout_tau.py --drafter "$1" --prompts "${4:-$HELD}" \
    --num-prompts ${NUM_PROMPTS:-16} --max-new-tokens ${MAX_NEW_TOKENS:-64} --k "$2" --threads "$THREADS" --out "$3.tmp"
  mv "$3.tmp" "$3"
}

train_lever() {  # $1 = lever; the shared cache, STEPS steps, no in-run probe (heldout evaluates the end)
  variant "$1"
  local out="$RUNS/$1" keep=2 every=60
  case "$1" in dflash_* | dspark_*) keep=null; every=30 ;; esac  # every checkpoint: tau at equal CPU time (curves)
  if [ ! -f "$out/final/config.json" ]; then  # the lever's overrides last: they win
    OMP_NUM_THREADS=$THREADS draftsmith train "recipes/smollm2/${KIND}_long.yaml" "$NO_MIX" \
      data.num_samples=$((STEPS * 4)) features.mode=offline "features.cache_dir=$RUNS/features" \
      train.epochs=null train.max_steps=$STEPS train.save_every=$every train.keep_last=$keep train.eval_every=null \
      eval.num_prompts=0 "output.dir=$out" train.resume_from=latest "${OVERRIDES[@]}"
  fi
  heldout "$out/final" "$K" "$out/heldout.json"
  case "$1" in mix_*)  # what the mix adds per domain: code and math first turns (evaluation sets, never trained on)
    for set in humaneval gsm8k; do heldout "$out/final" "$K" "$out/heldout_$set.json" "$set"; done ;;
  esac
}

mix_data() {  # the mix lever's data: the target's answers to ShareGPT code prompts and GSM8K questions, more than the
  # lever mixes in of each (TAKE): a prompt over regenerate.max_prompt_tokens stays unanswered and is not counted,
  # and a third of the code prompts are (74 of 110 answered at TAKE 90): 2 x TAKE of those, TAKE + 20 questions
  local take=${MIX_TAKE:-$((STEPS / 2))}
  local code_n=${MIX_N:-$((2 * take))} math_n=${MIX_N:-$((take + 20))}
  mkdir -p "$MIX"
  [ -f "$MIX/sharegpt_code_prompts.jsonl" ] || python benchmarks/training/mix_prompts.py --domain code \
    --num "$code_n" --out "$MIX/sharegpt_code_prompts.jsonl"
  local name prompts n
  for name in sharegpt_code gsm8k; do
    case "$name" in
      gsm8k) prompts=recipes/smollm2/data/gsm8k_train_questions.jsonl.gz n=$math_n ;;
      *) prompts="$MIX/sharegpt_code_prompts.jsonl" n=$code_n ;;
    esac
    # HF generate (the shipped file's settings: greedy, 256 new tokens, later turns while the prompt fits 256 tokens)
    OMP_NUM_THREADS=$THREADS draftsmith prepare recipes/smollm2/eagle3_long.yaml "data.path=$prompts" \
      "data.regenerated_path=$MIX/$name.jsonl" "data.mix=[]" "regenerate.num_conversations=$n" \
      regenerate.heldout_conversations=0 "regenerate.batch_size=$(((n + 1) / 2))" regenerate.use_vllm=false \
      features.mode=online
  done
}

report() {  # levers_screen.json / .md under $RUNS: every finished lever's held-out tau beside its group's base
  python benchmarks/training/levers_report.py --runs "$RUNS" --out "$RUNS/levers_screen.json" \
    --md "$RUNS/levers_screen.md" --commit "$(git rev-parse --short HEAD)" --threads "$THREADS" --steps "$STEPS" \
    --note "${NOTE:-nothing else noted}"
}

case "${1:-plan}" in
  plan)
    for name in $(levers_of); do
      variant "$name"
      echo "$name: recipes/smollm2/${KIND}_long.yaml ${OVERRIDES[*]:-} (k = $K)"
    done ;;
  levers)
    shift
    names=$(levers_of "$@")
    mkdir -p "$RUNS"
    case " $names " in *" mix_code_math "*) mix_data ;; esac
    # one cache for every lever but the mix's (online): DFlash's request is the widest (5 taps + final norm); the
    # others read a subset. The shipped answers are complete, so prepare regenerates nothing and needs no vLLM
    case " $names " in *" eagle3_"* | *" dflash_"* | *" dspark_"* | *" mtp_"*)
      OMP_NUM_THREADS=$THREADS draftsmith prepare recipes/smollm2/dflash_long.yaml data.num_samples=$((STEPS * 4)) \
        "$NO_MIX" features.mode=offline "features.cache_dir=$RUNS/features" regenerate.use_vllm=false ;;
    esac
    for name in $names; do train_lever "$name"; done
    report ;;
  report) report ;;
  fr)
    kind=${2:?levers.sh fr KIND N} size=${3:?levers.sh fr KIND N (the draft vocabulary size)}
    final=runs/smollm2_${kind}_long/final fr=runs/smollm2_${kind}_long_fr$size
    out=runs/long_eval/fr${size}_${kind}.json
    [ -f "$fr/config.json" ] || OMP_NUM_THREADS=$THREADS draftsmith export "$final" --format native \
      --draft-vocab-size "$size" --out "$fr"
    case "$kind" in mtp) ks=1,2,3,auto ;; *) ks=1,2,3,5,auto ;; esac
    mkdir -p runs/long_eval
    common=(--target smollm2-135m-instruct --drafter "$final,$fr" --max-new-tokens 96 --threads "$THREADS"
            --num-draft-tokens "$ks" --out "$out")
    has "$out" sharegpt_smollm2_10k.heldout ||
      OMP_NUM_THREADS=$THREADS draftsmith eval "${common[@]}" --prompts "$HELD" --num-prompts 32
    has "$out" mt_bench ||
      OMP_NUM_THREADS=$THREADS draftsmith eval "${common[@]}" --append --prompts mt_bench --num-prompts 16
    gzip -9n -c "$out" > "docs/results/fr${size}_${kind}_eval.json.gz"
    cp "${out%.json}.md" "docs/results/fr${size}_${kind}_eval.md" ;;
  long | full)
    stage=$1 kind=${2:?levers.sh $1 KIND (eagle3, dflash, dspark or mtp)}
    shift 2
    out=runs/smollm2_${kind}_long
    if [ ! -f "$out/final/config.json" ]; then
      OMP_NUM_THREADS=$THREADS draftsmith train "recipes/smollm2/${kind}_long.yaml" train.resume_from=latest "$@"
    fi
    case "$kind" in eagle3 | mtp) k=3 ;; *) k=7 ;; esac
    if [ "$stage" = long ]; then NUM_PROMPTS=${NUM_PROMPTS:-32} heldout "$out/final" "$k" "$out/heldout.json"; exit 0; fi
    # full: the table's three passes (docs/results/long_KIND_eval.*: git mv an earlier version's pair to
    # long_KIND_v1_eval.* first, with its provenance entry), then every checkpoint on the curve (an earlier
    # training's rows of this run stay as runs/smollm2_KIND_long$EARLIER)
    KINDS=$kind THREADS=$THREADS bash benchmarks/training/long_eval.sh
    OMP_NUM_THREADS=$THREADS python benchmarks/training/long_curves.py --run "$out" --k "$k" --threads "$THREADS" \
      --train-threads "$THREADS" --out docs/results/long_curves.json --png docs/results/long_curves.png \
      --earlier-suffix "${EARLIER:-_v1}" ;;
  curves)
    args=()
    for name in $LEVERS_dflash $LEVERS_dspark; do
      if [ -d "$RUNS/$name/checkpoints" ]; then args+=(--run "$RUNS/$name" --k 7); fi
    done
    OMP_NUM_THREADS=$THREADS python benchmarks/training/long_curves.py "${args[@]}" --threads "$THREADS" \
      --train-threads "$THREADS" --out "$RUNS/layer_curves.json" --png "$RUNS/layer_curves.png" ;;
  smoke)
    shift
    smoke=${SMOKE_DIR:-runs/levers_smoke}
    small=(data.num_samples=8 train.epochs=null train.max_steps=2 train.save_every=null train.eval_every=null
           eval.num_prompts=0 eval.num_batches=1)
    MIX="$smoke/mix" STEPS=4  # a mix lever mixes in 2 answers of each source, of 3 regenerated
    for name in ${*:-$(levers_of)}; do
      variant "$name"
      [ -f "$smoke/$name/final/config.json" ] && continue
      [ "$name" = mix_code_math ] && THREADS=1 MIX_N=3 mix_data
      OMP_NUM_THREADS=1 draftsmith train "recipes/smollm2/${KIND}_long.yaml" "$NO_MIX" "${OVERRIDES[@]}" \
        "${small[@]}" features.mode=online "output.dir=$smoke/$name"
    done
    if [ $# -eq 0 ]; then  # the lever plan's cache: written once from DFlash's request, read by a subset's readers
      OMP_NUM_THREADS=1 draftsmith prepare recipes/smollm2/dflash_long.yaml data.num_samples=8 "$NO_MIX" \
        features.mode=offline "features.cache_dir=$smoke/features" regenerate.use_vllm=false
      for name in eagle3_taps5 eagle3_base mtp_vocab8k; do
        variant "$name"
        [ -f "$smoke/offline_$name/final/config.json" ] && continue
        OMP_NUM_THREADS=1 draftsmith train "recipes/smollm2/${KIND}_long.yaml" "$NO_MIX" "${OVERRIDES[@]}" \
          "${small[@]}" features.mode=offline "features.cache_dir=$smoke/features" "output.dir=$smoke/offline_$name"
      done
      THREADS=1 NUM_PROMPTS=1 MAX_NEW_TOKENS=8 heldout "$smoke/offline_mtp_vocab8k/final" 3 \
        "$smoke/offline_mtp_vocab8k/heldout.json"
    fi ;;
  *) echo "levers.sh: plan | levers [GROUP..] | report | long | full KIND [k=v..] | fr KIND N | curves | smoke [LEVER..]" >&2
     exit 2 ;;
esac

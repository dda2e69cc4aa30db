"""Train the n-gram rescorer: a KenLM n-gram over a base tokenizer's token ids (paper Sec. 7.2, App. C.3).

    python training/build_ngram.py --model smollm2-135m-instruct --wikipedia \
        --text /work/shared/data/enwiki_wikiextractor_AA.txt.gz --order 4 --output ngram/enwiki-4gram.bin

Needs KenLM's lmplz and build_binary (`bash install.sh` builds them). Same options as `hf-bpd build-ngram`.
"""

import sys

from hf_bpd.rescorers.kenlm import cli_build_ngram

if __name__ == "__main__":
    sys.exit(cli_build_ngram())

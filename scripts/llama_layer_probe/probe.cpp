// Dump the target hidden states that llama.cpp's EAGLE-3 speculative decoder feeds a draft.
//
// It follows common/speculative.cpp (llama.cpp as vendored by llama-cpp-python 0.3.36): the draft GGUF's
// `eagle3.target_layers` come from llama_model_target_layer_ids(), each id k < n_layer turns on extraction of the
// *input* of target layer k (llama_set_embeddings_layer_inp), one prefill decodes the tokens, and
// llama_get_embeddings_layer_inp(k) returns [n_tokens, n_embd] float32 rows. The same calls, nothing else.
//
// usage: llama-eagle3-layer-probe TARGET.gguf DRAFT.gguf OUT.bin TOKEN [TOKEN ...]
// OUT.bin: int32 n_ids, int32 n_tokens, int32 n_embd, int32 ids[n_ids], float32 rows[n_ids][n_tokens][n_embd]
#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static llama_model * load(const char * path) {
    llama_model_params mp = llama_model_default_params();
    llama_model * m = llama_model_load_from_file(path, mp);
    if (m == nullptr) {
        fprintf(stderr, "cannot load %s\n", path);
        exit(1);
    }
    return m;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s TARGET.gguf DRAFT.gguf OUT.bin TOKEN [TOKEN ...]\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_model * target = load(argv[1]);
    llama_model * draft  = load(argv[2]);
    std::vector<llama_token> tokens;
    for (int i = 4; i < argc; ++i) {
        tokens.push_back((llama_token) atoi(argv[i]));
    }
    const int32_t   n_tok   = (int32_t) tokens.size();
    const int32_t * ids     = llama_model_target_layer_ids(draft);
    const int32_t   n_ids   = (int32_t) llama_model_target_layer_ids_n(draft);
    const int32_t   n_layer = llama_model_n_layer(target);
    const int32_t   n_embd  = llama_model_n_embd(target);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) n_tok + 16;
    llama_context * ctx = llama_init_from_model(target, cp);
    for (int32_t k = 0; k < n_ids; ++k) {
        if (ids[k] >= n_layer) {
            fprintf(stderr, "target layer id %d: only ids below n_layer %d are probed\n", ids[k], n_layer);
            return 1;
        }
        llama_set_embeddings_layer_inp(ctx, (uint32_t) ids[k], true);
    }
    if (llama_decode(ctx, llama_batch_get_one(tokens.data(), n_tok)) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    FILE * out = fopen(argv[3], "wb");
    if (out == nullptr) {
        fprintf(stderr, "cannot write %s\n", argv[3]);
        return 1;
    }
    const int32_t header[3] = {n_ids, n_tok, n_embd};
    fwrite(header, sizeof(int32_t), 3, out);
    fwrite(ids, sizeof(int32_t), (size_t) n_ids, out);
    for (int32_t k = 0; k < n_ids; ++k) {
        fwrite(llama_get_embeddings_layer_inp(ctx, (uint32_t) ids[k]), sizeof(float), (size_t) n_tok * n_embd, out);
    }
    fclose(out);
    llama_free(ctx);
    llama_model_free(draft);
    llama_model_free(target);
    llama_backend_free();
    return 0;
}

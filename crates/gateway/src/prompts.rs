//! The prompt encoder in force (`gateway.tokenizer`, `gateway.tokenizer_config`):
//! loaded before the picker serves (a file that does not load stops the
//! start, naming it), and loaded again on a thread of its own when a reload
//! names other files, the old one serving until the new one is ready (a
//! model's tokenizer.json takes about a second to read). A reload whose
//! files do not load keeps the old encoder and says why.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::prompt::{PromptEncoder, PromptError};
use dpcoord_daemon::config::Gateway;

/// The block size of text-approximate keys, in pseudo-tokens (4 bytes
/// each): they only ever meet dpcoord's own placements, so any fixed size does.
const TEXT_BLOCK: u32 = 16;

type Files = (Option<PathBuf>, Option<PathBuf>);

fn files(g: &Gateway) -> Files {
    (g.tokenizer.clone(), g.tokenizer_config.clone())
}

fn load(f: &Files) -> Result<PromptEncoder, PromptError> {
    let encoder = PromptEncoder::from_files(f.0.as_deref(), f.1.as_deref(), TEXT_BLOCK)?;
    if let Some(why) = encoder.chat_template_problem() {
        tracing::warn!(reason = %why, "chats through the gateway are keyed by their text");
    }
    Ok(encoder)
}

pub struct Prompts {
    state: Mutex<State>,
}

struct State {
    /// The files of `encoder`, and those being loaded, if any.
    files: Files,
    loading: Option<Files>,
    encoder: Arc<PromptEncoder>,
}

impl Prompts {
    /// The encoder of `g`'s files, loaded now.
    pub fn load(g: &Gateway) -> Result<Prompts, PromptError> {
        let files = files(g);
        let encoder = Arc::new(load(&files)?);
        Ok(Prompts { state: Mutex::new(State { files, loading: None, encoder }) })
    }

    /// The encoder to use for a request under `g`; when `g` names other
    /// files, their load starts and the current encoder serves meanwhile.
    pub fn encoder(self: &Arc<Self>, g: &Gateway) -> Arc<PromptEncoder> {
        let wanted = files(g);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.files != wanted && st.loading.as_ref() != Some(&wanted) {
            st.loading = Some(wanted.clone());
            let me = Arc::clone(self);
            let spawned = std::thread::Builder::new().name("dpcoord-tokenizer".into()).spawn(move || me.reload(wanted));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start the tokenizer loader; the old tokenizer stays");
                st.loading = None;
            }
        }
        Arc::clone(&st.encoder)
    }

    fn reload(&self, wanted: Files) {
        let loaded = load(&wanted);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match loaded {
            Ok(encoder) => {
                tracing::info!(tokenizer = ?wanted.0, "gateway tokenizer loaded");
                (st.files, st.encoder) = (wanted, Arc::new(encoder));
            }
            // Not asked again until the settings change.
            Err(e) => {
                tracing::warn!(error = %e, "the reloaded gateway tokenizer does not load; the old one stays");
                st.files = wanted;
            }
        }
        st.loading = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_to_a_file_that_does_not_load_keeps_the_old_encoder() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("tokenizer.json");
        std::fs::write(&bad, b"{ not a tokenizer").unwrap();
        let g = Gateway::default();
        let p = Arc::new(Prompts::load(&g).unwrap());
        assert!(!p.encoder(&g).has_tokenizer());
        let err = Prompts::load(&Gateway { tokenizer: Some(bad.clone()), ..Gateway::default() }).err().unwrap();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        let reloaded = Gateway { tokenizer: Some(bad), ..Gateway::default() };
        let before = p.encoder(&reloaded);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while p.state.lock().unwrap().loading.is_some() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(Arc::ptr_eq(&before, &p.encoder(&reloaded)), "the old encoder serves");
        assert!(p.state.lock().unwrap().loading.is_none(), "not loaded again for the same settings");
    }
}

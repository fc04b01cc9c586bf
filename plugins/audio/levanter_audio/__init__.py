"""Audio for levanter-core: reading and resampling audio files (:mod:`levanter_audio.io`),
Whisper's log-mel features (:mod:`levanter_audio.features`), JSON-lines manifests of
(audio, transcript) pairs (:mod:`levanter_audio.manifest`) and speech synthesized offline
with eSpeak NG (:mod:`levanter_audio.synth`).

Nothing is imported here, so that importing the package stays cheap: import the module
you need."""

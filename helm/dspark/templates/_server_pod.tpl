{{/* The server pod template (metadata + spec), shared by the StatefulSet and both templates of
the LeaderWorkerSet. Usage: include "dspark.serverPodTemplate" (dict "ctx" $ "role" "single"
"pd" "") with role single (StatefulSet pod), leader (multi-node rank 0: the HTTP API) or worker
(rank 1..nodes-1: SGLang answers /health only), and pd "" or, with
server.disaggregation.enabled, prefill or decode (a single pod per replica). */}}
{{- define "dspark.serverPodTemplate" -}}
{{- $ := .ctx }}
{{- $role := .role }}
{{- $pd := .pd | default "" }}
{{- $s := $.Values.server }}
{{- $dis := $s.disaggregation }}
{{- $resources := $s.resources }}
{{- $securityContext := $s.securityContext }}
{{- if $pd }}
{{- $resources = default $s.resources (index $dis $pd).resources }}
{{- /* RDMA registers (pins) the KV buffers: IPC_LOCK, on the PD server containers only */}}
{{- $securityContext = merge (dict "capabilities" (dict "add" (list "IPC_LOCK"))) (deepCopy $s.securityContext) }}
{{- end }}
{{- $spec := $.Values.speculative }}
{{- $models := $.Values.models }}
{{- $gpus := include "dspark.gpus" $ | int }}
{{- $draft := include "dspark.draftPath" $ }}
{{- $cal := $.Values.calibration }}
{{- $cache := trimSuffix "/" $s.cache.mountPath -}}
metadata:
  labels:
    {{- include "dspark.componentLabels" (dict "ctx" $ "component" "server") | nindent 4 }}
    {{- if ne $role "single" }}
    dspark.io/role: {{ $role }}
    {{- end }}
    {{- with $pd }}
    dspark.io/pd-role: {{ . }}
    {{- end }}
    {{- with $s.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Roll the pods when calibration tables change.
    checksum/calibration: {{ include (print $.Template.BasePath "/calibration-configmap.yaml") $ | sha256sum }}
    {{- if eq $pd "prefill" }}
    # SMG's Kubernetes discovery reads a prefill pod's bootstrap port from this annotation.
    sglang.ai/bootstrap-port: {{ int $dis.bootstrapPort | quote }}
    {{- end }}
    {{- with $s.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "dspark.serviceAccountName" $ }}
  automountServiceAccountToken: false
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $s.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $s.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ int $s.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml $s.podSecurityContext | nindent 4 }}
  {{- if has $models.source (list "download" "embedded" "prefetch") }}
  initContainers:
    {{- if eq $models.source "download" }}
    - name: download-models
      image: {{ include "dspark.imageOr" (dict "ctx" $ "image" $models.download.image) }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: ["python3", "/opt/dspark/scripts/download_models.py"]
      env:
        {{- include "dspark.downloadEnv" $ | nindent 8 }}
      resources:
        {{- toYaml $models.download.resources | nindent 8 }}
      securityContext:
        {{- toYaml $s.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: {{ $models.mountPath }}
        - name: scripts
          mountPath: /opt/dspark/scripts
          readOnly: true
        - name: tmp
          mountPath: /tmp
    {{- else if eq $models.source "prefetch" }}
    # Blocks until the prefetch Job has completed every model (it alone writes the volume).
    - name: wait-for-models
      image: {{ include "dspark.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: ["python3", "/opt/dspark/scripts/download_models.py", "--wait"]
      env:
        - name: DSPARK_MODELS
          value: {{ include "dspark.downloadList" $ | quote }}
        - name: DSPARK_WAIT_TIMEOUT_SECONDS
          value: {{ int $models.prefetch.waitTimeoutSeconds | quote }}
      resources:
        requests:
          cpu: 50m
          memory: 64Mi
        limits:
          memory: 256Mi
      securityContext:
        {{- toYaml $s.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: {{ $models.mountPath }}
          readOnly: true
        - name: scripts
          mountPath: /opt/dspark/scripts
          readOnly: true
    {{- else }}
    - name: prepare-embedded-models
      image: {{ include "dspark.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command:
        - /bin/sh
        - -c
        - |
          {{- $models.embedded.script | trim | nindent 10 }}
      env:
        - name: MODELS_DIR
          value: {{ $models.mountPath | quote }}
        - name: HOME
          value: /tmp
        - name: HF_HOME
          value: /tmp/huggingface
        - name: XDG_CACHE_HOME
          value: /tmp/cache
      resources:
        {{- toYaml $models.embedded.resources | nindent 8 }}
      securityContext:
        {{- toYaml $s.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: {{ $models.mountPath }}
        - name: tmp
          mountPath: /tmp
    {{- end }}
  {{- end }}
  containers:
    - name: sglang
      image: {{ include "dspark.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: ["python3", "-m", "sglang.launch_server"]
      args:
        - --model-path
        - {{ include "dspark.targetPath" $ | quote }}
        - --host
        - "0.0.0.0"
        - --port
        - {{ int $s.port | quote }}
        - --tp-size
        - {{ int $s.tpSize | quote }}
        - --dp-size
        - {{ int $s.dpSize | quote }}
        {{- if gt (int $s.attnDpSize) 1 }}
        - --attn-dp-size
        - {{ int $s.attnDpSize | quote }}
        {{- end }}
        {{- if gt (int $s.epSize) 1 }}
        - --ep-size
        - {{ int $s.epSize | quote }}
        {{- end }}
        {{- if $s.enableDpLmHead }}
        - --enable-dp-lm-head
        {{- end }}
        {{- with $s.moeA2aBackend }}
        - --moe-a2a-backend
        - {{ . | quote }}
        {{- end }}
        {{- if $pd }}
        - --disaggregation-mode
        - {{ $pd | quote }}
        - --disaggregation-transfer-backend
        - {{ $dis.transferBackend | quote }}
        {{- if eq $pd "prefill" }}
        # decode servers fetch the KV location here (the router tells them where)
        - --disaggregation-bootstrap-port
        - {{ int $dis.bootstrapPort | quote }}
        {{- end }}
        {{- with $dis.ibDevice }}
        - --disaggregation-ib-device
        - {{ . | quote }}
        {{- end }}
        {{- end }}
        {{- if ne $role "single" }}
        # Rank and rendezvous from the LeaderWorkerSet's environment (LWS_*, set by its webhook).
        - --nnodes
        - {{ int $s.multiNode.nodes | quote }}
        - --node-rank
        - "$(LWS_WORKER_INDEX)"
        - --dist-init-addr
        - {{ printf "$(LWS_LEADER_ADDRESS):%d" (int $s.multiNode.distInitPort) | quote }}
        {{- end }}
        - --dtype
        - {{ $s.dtype | quote }}
        {{- if not (kindIs "invalid" $s.maxRunningRequests) }}
        - --max-running-requests
        - {{ int $s.maxRunningRequests | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $s.memFractionStatic) }}
        - --mem-fraction-static
        - {{ $s.memFractionStatic | toString | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $s.contextLength) }}
        - --context-length
        - {{ int $s.contextLength | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $s.maxTotalTokens) }}
        - --max-total-tokens
        - {{ int $s.maxTotalTokens | quote }}
        {{- end }}
        {{- with $s.device }}
        - --device
        - {{ . | quote }}
        {{- end }}
        {{- with $s.attentionBackend }}
        - --attention-backend
        - {{ . | quote }}
        {{- end }}
        {{- with $s.servedModelName }}
        - --served-model-name
        - {{ . | quote }}
        {{- end }}
        {{- if $s.trustRemoteCode }}
        - --trust-remote-code
        {{- end }}
        {{- if $.Values.monitoring.enableMetrics }}
        - --enable-metrics
        {{- end }}
        {{- if ne $spec.algorithm "NONE" }}
        - --speculative-algorithm
        - {{ $spec.algorithm | quote }}
        {{- if $draft }}
        - --speculative-draft-model-path
        - {{ $draft | quote }}
        {{- end }}
        {{- end }}
        {{- if eq $spec.algorithm "DSPARK" }}
        {{- if not (kindIs "invalid" $spec.dspark.blockSize) }}
        - --speculative-dspark-block-size
        - {{ int $spec.dspark.blockSize | quote }}
        {{- end }}
        {{- if (include "dspark.calibrationOn" $cal.sts) }}
        - --speculative-dspark-confidence-sts-path
        - {{ printf "%s/sts/%s" (trimSuffix "/" $cal.mountPath) $cal.sts.key | quote }}
        {{- end }}
        {{- if (include "dspark.calibrationOn" $cal.sps) }}
        - --speculative-dspark-sps-table-path
        - {{ printf "%s/sps/%s" (trimSuffix "/" $cal.mountPath) $cal.sps.key | quote }}
        {{- end }}
        {{- if $spec.dspark.alignVerifyTokensToGraphTier }}
        - --speculative-dspark-align-verify-tokens-to-graph-tier
        {{- end }}
        {{- else if include "dspark.isEagle" $ }}
        - --speculative-num-steps
        - {{ int $spec.eagle.numSteps | quote }}
        - --speculative-eagle-topk
        - {{ int $spec.eagle.topk | quote }}
        - --speculative-num-draft-tokens
        - {{ int $spec.eagle.numDraftTokens | quote }}
        {{- if $spec.eagle.rejectionSampling }}
        {{- if ne (int $spec.eagle.topk) 1 }}
        {{- fail (printf "speculative.eagle.rejectionSampling needs speculative.eagle.topk 1 (SGLang's chain rejection sampler verifies one chain); got topk %d" (int $spec.eagle.topk)) }}
        {{- end }}
        - --speculative-use-rejection-sampling
        {{- end }}
        {{- end }}
        {{- range $s.extraArgs }}
        - {{ . | quote }}
        {{- end }}
        {{- if $pd }}
        {{- range (index $dis $pd).extraArgs }}
        - {{ . | quote }}
        {{- end }}
        {{- end }}
      env:
        {{- if eq $spec.algorithm "DSPARK" }}
        {{- $needs := ternary "static" "compact" (eq $spec.dspark.scheduler "static") }}
        {{- if ne $spec.dspark.raggedVerifyMode $needs }}
        {{- fail (printf "speculative.dspark.scheduler=%s needs speculative.dspark.raggedVerifyMode=%s (got %s): the sglang-dspark plugin refuses the combination at start-up" $spec.dspark.scheduler $needs $spec.dspark.raggedVerifyMode) }}
        {{- end }}
        - name: SGLANG_RAGGED_VERIFY_MODE
          value: {{ $spec.dspark.raggedVerifyMode | quote }}
        - name: SGLANG_DSPARK_SCHEDULER
          value: {{ $spec.dspark.scheduler | quote }}
        {{- end }}
        {{- if include "dspark.isCPU" $ }}
        - name: SGLANG_USE_CPU_ENGINE
          value: "1"
        {{- end }}
        # Model paths are always local: never reach out to the Hub at start-up.
        - name: HF_HUB_OFFLINE
          value: "1"
        - name: HF_HUB_DISABLE_TELEMETRY
          value: "1"
        # The root filesystem is read-only: HOME is scratch on /tmp, every cache that should
        # outlive the pod is under server.cache.mountPath.
        - name: HOME
          value: /tmp/home
        - name: DSPARK_CACHE_DIR
          value: {{ printf "%s/dspark" $cache | quote }}
        - name: SGLANG_CACHE_DIR
          value: {{ printf "%s/sglang" $cache | quote }}
        - name: XDG_CACHE_HOME
          value: {{ printf "%s/xdg" $cache | quote }}
        # SGLang derives these from SGLANG_CACHE_DIR when it starts early enough; set them so
        # no library finds its own default first.
        - name: TRITON_CACHE_DIR
          value: {{ printf "%s/sglang/triton" $cache | quote }}
        - name: TORCHINDUCTOR_CACHE_DIR
          value: {{ printf "%s/sglang/inductor" $cache | quote }}
        - name: CUDA_CACHE_PATH
          value: {{ printf "%s/sglang/nv" $cache | quote }}
        - name: TILELANG_CACHE_DIR
          value: {{ printf "%s/sglang/tilelang" $cache | quote }}
        - name: FLASHINFER_WORKSPACE_BASE
          value: {{ printf "%s/sglang" $cache | quote }}
        # SGLang's own JIT kernels (default ~/.cache/sglang/jit, i.e. under the scratch HOME).
        - name: SGLANG_JIT_CACHE_DIR
          value: {{ printf "%s/sglang/jit" $cache | quote }}
        # The image sets HF_HOME under its home directory, which the read-only root would refuse.
        - name: HF_HOME
          value: {{ printf "%s/huggingface" $cache | quote }}
        {{- with $s.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ int $s.port }}
          protocol: TCP
        {{- if eq $role "leader" }}
        - name: dist-init
          containerPort: {{ int $s.multiNode.distInitPort }}
          protocol: TCP
        {{- end }}
        {{- if eq $pd "prefill" }}
        - name: bootstrap
          containerPort: {{ int $dis.bootstrapPort }}
          protocol: TCP
        {{- end }}
      startupProbe:
        {{- toYaml $s.startupProbe | nindent 8 }}
      livenessProbe:
        {{- toYaml $s.livenessProbe | nindent 8 }}
      readinessProbe:
        {{- if eq $role "worker" }}
        # Workers serve no API: SGLang answers /health on them once their ranks are up.
        {{- toYaml (merge (dict "httpGet" (dict "path" "/health" "port" "http")) (omit $s.readinessProbe "httpGet")) | nindent 8 }}
        {{- else }}
        {{- toYaml $s.readinessProbe | nindent 8 }}
        {{- end }}
      resources:
        requests:
          {{- with $resources.requests }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- if gt $gpus 0 }}
          {{ $s.gpuResourceName }}: {{ $gpus }}
          {{- end }}
          {{- if include "dspark.multiNode" $ }}
          {{- with $s.multiNode.extraResources }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- end }}
          {{- if and $pd $dis.rdma.resourceName }}
          {{ $dis.rdma.resourceName }}: {{ int $dis.rdma.count }}
          {{- end }}
        limits:
          {{- with $resources.limits }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- if gt $gpus 0 }}
          {{ $s.gpuResourceName }}: {{ $gpus }}
          {{- end }}
          {{- if include "dspark.multiNode" $ }}
          {{- with $s.multiNode.extraResources }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- end }}
          {{- if and $pd $dis.rdma.resourceName }}
          {{ $dis.rdma.resourceName }}: {{ int $dis.rdma.count }}
          {{- end }}
      securityContext:
        {{- toYaml $securityContext | nindent 8 }}
      volumeMounts:
        {{- if include "dspark.hasModelVolume" $ }}
        # SGLang only reads the weights.
        - name: models
          mountPath: {{ $models.mountPath }}
          readOnly: true
          {{- if eq $models.source "pvc" }}
          {{- with $models.pvc.subPath }}
          subPath: {{ . }}
          {{- end }}
          {{- end }}
        {{- end }}
        - name: cache
          mountPath: {{ $s.cache.mountPath }}
        {{- if $s.shm.enabled }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- if (include "dspark.calibrationOn" $cal.sts) }}
        - name: calibration-sts
          mountPath: {{ printf "%s/sts" (trimSuffix "/" $cal.mountPath) }}
          readOnly: true
        {{- end }}
        {{- if (include "dspark.calibrationOn" $cal.sps) }}
        - name: calibration-sps
          mountPath: {{ printf "%s/sps" (trimSuffix "/" $cal.mountPath) }}
          readOnly: true
        {{- end }}
        - name: tmp
          mountPath: /tmp
  volumes:
    {{- if eq $models.source "pvc" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ $models.pvc.claimName }}
        readOnly: {{ $models.pvc.readOnly }}
    {{- else if eq $models.source "prefetch" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ include "dspark.prefetchClaim" $ }}
        readOnly: true
    - name: scripts
      configMap:
        name: {{ include "dspark.fullname" $ }}-scripts
        defaultMode: 0444
    {{- else if eq $models.source "download" }}
    - name: models
      {{- if eq $models.download.storage "persistentVolumeClaim" }}
      persistentVolumeClaim:
        claimName: {{ $models.download.persistentVolumeClaim.claimName }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $models.download.emptyDir.sizeLimit }}
      {{- end }}
    - name: scripts
      configMap:
        name: {{ include "dspark.fullname" $ }}-scripts
        defaultMode: 0444
    {{- else if eq $models.source "embedded" }}
    - name: models
      emptyDir:
        sizeLimit: {{ $models.embedded.sizeLimit }}
    {{- end }}
    {{- if eq $s.cache.storage "emptyDir" }}
    - name: cache
      emptyDir:
        sizeLimit: {{ $s.cache.sizeLimit }}
    {{- else if eq $s.cache.storage "persistentVolumeClaim" }}
    - name: cache
      persistentVolumeClaim:
        claimName: {{ $s.cache.existingClaim }}
    {{- end }}
    {{- if $s.shm.enabled }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $s.shm.sizeLimit }}
    {{- end }}
    {{- if (include "dspark.calibrationOn" $cal.sts) }}
    - name: calibration-sts
      configMap:
        name: {{ include "dspark.calibrationConfigMap" (dict "ctx" $ "cfg" $cal.sts) }}
        items:
          - key: {{ $cal.sts.key }}
            path: {{ $cal.sts.key }}
    {{- end }}
    {{- if (include "dspark.calibrationOn" $cal.sps) }}
    - name: calibration-sps
      configMap:
        name: {{ include "dspark.calibrationConfigMap" (dict "ctx" $ "cfg" $cal.sps) }}
        items:
          - key: {{ $cal.sps.key }}
            path: {{ $cal.sps.key }}
    {{- end }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ $s.tmp.sizeLimit }}
  {{- with $s.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $s.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $s.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $s.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The per-pod cache claim (server.cache.storage=volumeClaimTemplate). */}}
{{- define "dspark.cacheClaimTemplate" -}}
- metadata:
    name: cache
    labels:
      {{- include "dspark.componentSelectorLabels" (dict "ctx" . "component" "server") | nindent 6 }}
  spec:
    accessModes: ["ReadWriteOnce"]
    {{- with .Values.server.cache.storageClassName }}
    storageClassName: {{ . }}
    {{- end }}
    resources:
      requests:
        storage: {{ .Values.server.cache.size }}
{{- end }}

{{/* Environment of a container that downloads the models (init container or prefetch Job). */}}
{{- define "dspark.downloadEnv" -}}
{{- $models := .Values.models }}
- name: DSPARK_MODELS
  value: {{ include "dspark.downloadList" . | quote }}
- name: HF_HOME
  value: {{ printf "%s/.hf-home" (trimSuffix "/" $models.mountPath) | quote }}
# the root filesystem is read-only
- name: HOME
  value: /tmp
- name: HF_HUB_DISABLE_TELEMETRY
  value: "1"
{{- with $models.download.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $models.download.hfTokenSecret.key }}
{{- end }}
{{- with $models.download.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "dspark.prefetchClaim" -}}
{{- default (printf "%s-models" (include "dspark.fullname" .)) .Values.models.prefetch.persistentVolumeClaim.existingClaim }}
{{- end }}

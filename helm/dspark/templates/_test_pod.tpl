{{/* A helm test Pod running one script of the tests ConfigMap.
     Usage: include "dspark.testPod" (dict "ctx" $ "name" "chat" "script" "test_chat.py" "env" (list ...)
     "apiKey" true); apiKey: pass the router's key (router.apiKey) as API_KEY. */}}
{{- define "dspark.testPod" -}}
{{- $ctx := .ctx }}
{{- $t := $ctx.Values.tests }}
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "dspark.fullname" $ctx }}-test-{{ .name }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" (dict "ctx" $ctx "component" "test") | nindent 4 }}
  annotations:
    helm.sh/hook: test
    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65534
    runAsGroup: 65534
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: {{ .name }}
      image: {{ printf "%s:%s" $t.image.repository $t.image.tag }}
      imagePullPolicy: {{ $t.image.pullPolicy }}
      command: ["python3", "-B", "/tests/{{ .script }}"]
      env:
        - name: TIMEOUT_SECONDS
          value: {{ int $t.timeoutSeconds | quote }}
        {{- range .env }}
        - name: {{ .name }}
          value: {{ .value | quote }}
        {{- end }}
        {{- if and .apiKey $ctx.Values.router.enabled $ctx.Values.router.apiKey.secretName }}
        - name: API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ $ctx.Values.router.apiKey.secretName }}
              key: {{ $ctx.Values.router.apiKey.key }}
        {{- end }}
      resources:
        requests:
          cpu: 50m
          memory: 64Mi
        limits:
          memory: 128Mi
      securityContext:
        allowPrivilegeEscalation: false
        privileged: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
      volumeMounts:
        - name: tests
          mountPath: /tests
          readOnly: true
  volumes:
    - name: tests
      configMap:
        name: {{ include "dspark.fullname" $ctx }}-tests
{{- end }}

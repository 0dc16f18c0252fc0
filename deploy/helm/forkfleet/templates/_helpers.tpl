{{- define "forkfleet.labels" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/name: {{ .root.Release.Name }}-{{ .component }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: forkfleet
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
{{- end -}}

{{- define "forkfleet.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "forkfleet.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "forkfleet.securityContext" -}}
runAsNonRoot: true
runAsUser: 65532
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "forkfleet.natsUrl" -}}
{{- if .Values.nats.enabled -}}
nats://{{ .Release.Name }}-nats:4222
{{- else -}}
{{- required "nats.external.url is required when nats.enabled is false" .Values.nats.external.url -}}
{{- end -}}
{{- end -}}

{{- define "forkfleet.workerGrace" -}}
{{- add .Values.preStopSleepSeconds .Values.drainGraceSeconds 25 -}}
{{- end -}}

{{/* The volumes and mounts every forkfleet container has: config, NATS credentials, TLS CA, /tmp. */}}
{{- define "forkfleet.mounts" -}}
- name: config
  mountPath: /etc/forkfleet
  readOnly: true
{{- if .Values.nats.credentialsSecret }}
- name: nats-creds
  mountPath: /run/secrets/nats
  readOnly: true
{{- end }}
{{- if .Values.nats.tls.caSecret }}
- name: nats-ca
  mountPath: /run/secrets/nats-ca
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "forkfleet.volumes" -}}
- name: config
  configMap:
    name: {{ .Release.Name }}-config
{{- if .Values.nats.credentialsSecret }}
- name: nats-creds
  secret:
    secretName: {{ .Values.nats.credentialsSecret }}
{{- end }}
{{- if .Values.nats.tls.caSecret }}
- name: nats-ca
  secret:
    secretName: {{ .Values.nats.tls.caSecret }}
{{- end }}
{{- end -}}

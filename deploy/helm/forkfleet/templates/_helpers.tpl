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
{{ ternary "tls" "nats" .Values.nats.tls.enabled }}://{{ .Release.Name }}-nats:4222
{{- else -}}
{{- required "nats.external.url is required when nats.enabled is false" .Values.nats.external.url -}}
{{- end -}}
{{- end -}}

{{- define "forkfleet.workerGrace" -}}
{{- add .Values.preStopSleepSeconds .Values.drainGraceSeconds 25 -}}
{{- end -}}

{{/* "true" when the chart makes the NATS users (auth on, bundled NATS, no auth.conf given). */}}
{{- define "forkfleet.generatedAuth" -}}
{{- if and .Values.auth.enabled .Values.nats.enabled (not .Values.auth.existingSecrets.nats) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the chart makes the certificates (TLS on, bundled NATS, no certificate given). */}}
{{- define "forkfleet.generatedTls" -}}
{{- if and .Values.nats.tls.enabled .Values.nats.enabled (not .Values.nats.tls.existingSecret) -}}true{{- end -}}
{{- end -}}

{{/* The roles the chart makes credentials for, as a JSON array. */}}
{{- define "forkfleet.roles" -}}
{{- $roles := list "coordinator" "worker" "admin" -}}
{{- range .Values.auth.clients }}{{ $roles = append $roles (printf "client-%s" .) }}{{ end -}}
{{- $roles | toJson -}}
{{- end -}}

{{/* Refuse values that cannot deploy the roles: called by every workload. */}}
{{- define "forkfleet.checkAuth" -}}
{{- $a := .Values.auth -}}
{{- $t := .Values.nats.tls -}}
{{- if $a.enabled -}}
{{- if not (include "forkfleet.generatedAuth" .) -}}
{{- range $role := list "coordinator" "worker" "admin" -}}
{{- if not (index $a.existingSecrets $role).name -}}
{{- fail (printf "auth.existingSecrets.%s.name is required: with %s the chart cannot make the role's credentials (run `forkfleet cluster auth` and make a Secret of each role's file, docs/DEPLOY.md)" $role (ternary "auth.existingSecrets.nats" "nats.enabled false" $.Values.nats.enabled)) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- range $role := list "coordinator" "worker" "admin" -}}
{{- if (index $a.existingSecrets $role).name -}}
{{- fail (printf "auth.existingSecrets.%s needs auth.existingSecrets.nats too: the bundled NATS must know the keys of the Secrets you give (the auth.conf of the same `forkfleet cluster auth` run)" $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $t.enabled $t.verifyClients (not (include "forkfleet.generatedTls" .)) -}}
{{- range $role := list "coordinator" "worker" "admin" -}}
{{- if not (index $t.clientSecrets $role) -}}
{{- fail (printf "nats.tls.clientSecrets.%s is required: with nats.tls.verifyClients and %s the chart makes no client certificates (a kubernetes.io/tls Secret per role, e.g. from cert-manager; or nats.tls.verifyClients false)" $role (ternary "nats.tls.existingSecret" "nats.enabled false" $.Values.nats.enabled)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $role, $name := $t.clientSecrets -}}
{{- if and $name (eq $name $t.existingSecret) -}}
{{- fail (printf "nats.tls.clientSecrets.%s names nats.tls.existingSecret, the server's certificate: its pods would hold the server's private key; give each role a client certificate of its own" $role) -}}
{{- end -}}
{{- end -}}
{{- if and $a.existingSecrets.nats (not .Values.nats.enabled) -}}
{{- fail "auth.existingSecrets.nats configures the bundled NATS; with nats.enabled false give your server the auth.conf yourself" -}}
{{- end -}}
{{- end -}}

{{/*
The environment that connects a process of one role to NATS: its credentials, TLS and,
under roles, no provisioning for anyone but the coordinator. Called with (dict "root" $
"role" ROLE), ROLE coordinator, worker or admin.
*/}}
{{- define "forkfleet.natsEnv" -}}
{{- $v := .root.Values -}}
{{- $role := .role -}}
{{- if $v.auth.enabled }}
{{- if include "forkfleet.generatedAuth" .root }}
- {name: FORKFLEET_NATS_USER, value: {{ $role }}}
- {name: FORKFLEET_NATS_PASSWORD_FILE, value: /run/secrets/nats/password}
{{- else }}
{{- $s := index $v.auth.existingSecrets $role }}
- name: {{ ternary "FORKFLEET_NATS_CREDS_FILE" "FORKFLEET_NATS_NKEY_SEED_FILE" (hasSuffix ".creds" $s.key) }}
  value: /run/secrets/nats-creds/{{ $s.key }}
{{- end }}
{{- if ne $role "coordinator" }}
# Under roles only the coordinator creates streams and buckets.
- {name: FORKFLEET_NATS_PROVISION, value: "false"}
{{- end }}
{{- end }}
{{- if $v.nats.tls.enabled }}
- {name: FORKFLEET_NATS_TLS_REQUIRE, value: "true"}
{{- if include "forkfleet.generatedTls" .root }}
- {name: FORKFLEET_NATS_TLS_CA_FILE, value: /run/secrets/nats/ca.crt}
{{- else if or $v.nats.enabled $v.nats.tls.caSecret }}
- {name: FORKFLEET_NATS_TLS_CA_FILE, value: /run/secrets/nats-ca/ca.crt}
{{- end }}
{{- if $v.nats.tls.verifyClients }}
{{- $dir := ternary "/run/secrets/nats" "/run/secrets/nats-tls" (eq (include "forkfleet.generatedTls" .root) "true") }}
- {name: FORKFLEET_NATS_TLS_CERT_FILE, value: {{ $dir }}/tls.crt}
- {name: FORKFLEET_NATS_TLS_KEY_FILE, value: {{ $dir }}/tls.key}
{{- end }}
{{- end }}
{{- end -}}

{{/* The volumes and mounts every forkfleet container has: config, its role's NATS
credentials and certificates, /tmp. Called with (dict "root" $ "role" ROLE). */}}
{{- define "forkfleet.mounts" -}}
{{- $v := .root.Values -}}
- name: config
  mountPath: /etc/forkfleet
  readOnly: true
{{- if or (include "forkfleet.generatedAuth" .root) (and $v.nats.tls.enabled (include "forkfleet.generatedTls" .root)) }}
- name: nats-role
  mountPath: /run/secrets/nats
  readOnly: true
{{- end }}
{{- if and $v.auth.enabled (not (include "forkfleet.generatedAuth" .root)) }}
- name: nats-creds
  mountPath: /run/secrets/nats-creds
  readOnly: true
{{- end }}
{{- if and $v.nats.tls.enabled (not (include "forkfleet.generatedTls" .root)) }}
{{- if or $v.nats.enabled $v.nats.tls.caSecret }}
- name: nats-ca
  mountPath: /run/secrets/nats-ca
  readOnly: true
{{- end }}
{{- if $v.nats.tls.verifyClients }}
- name: nats-tls
  mountPath: /run/secrets/nats-tls
  readOnly: true
{{- end }}
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "forkfleet.volumes" -}}
{{- $v := .root.Values -}}
{{- $rel := .root.Release.Name -}}
- name: config
  configMap:
    name: {{ $rel }}-config
{{- if or (include "forkfleet.generatedAuth" .root) (and $v.nats.tls.enabled (include "forkfleet.generatedTls" .root)) }}
- name: nats-role
  secret:
    secretName: {{ $rel }}-nats-{{ .role }}
    defaultMode: 0440
{{- end }}
{{- if and $v.auth.enabled (not (include "forkfleet.generatedAuth" .root)) }}
{{- $s := index $v.auth.existingSecrets .role }}
- name: nats-creds
  secret:
    secretName: {{ $s.name }}
    defaultMode: 0440
    items:
      - {key: {{ $s.key }}, path: {{ $s.key }}}
{{- end }}
{{- if and $v.nats.tls.enabled (not (include "forkfleet.generatedTls" .root)) }}
{{- if $v.nats.enabled }}
- name: nats-ca
  secret:
    secretName: {{ $v.nats.tls.existingSecret }}
    items:
      - {key: ca.crt, path: ca.crt}
{{- else if $v.nats.tls.caSecret }}
- name: nats-ca
  secret:
    secretName: {{ $v.nats.tls.caSecret }}
    items:
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if $v.nats.tls.verifyClients }}
- name: nats-tls
  secret:
    secretName: {{ index $v.nats.tls.clientSecrets .role }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}
{{- end -}}

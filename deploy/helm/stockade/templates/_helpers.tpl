{{/* The release's full name (at most 63 characters, as Kubernetes names are). */}}
{{- define "stockade.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "stockade.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "stockade.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "stockade.serviceAccount" -}}
{{- .Values.serviceAccount.name | default (include "stockade.fullname" .) -}}
{{- end -}}

{{- define "stockade.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* A rules file's ConfigMap key: its path with "/" flattened to "__" (keys cannot hold "/"). */}}
{{- define "stockade.ruleKey" -}}
{{- regexReplaceAll "/" . "__" -}}
{{- end -}}

{{/* Fails with a clear message on values the templates cannot make sense of. */}}
{{- define "stockade.check" -}}
{{- if not .Values.rules.files -}}
{{- fail "rules.files is empty: give the rules repository's files (path -> content), see docs/deploy.md \"Rules from Git\"" -}}
{{- end -}}
{{- range $path, $_ := .Values.rules.files -}}
{{- if or (not (regexMatch "^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$" $path)) (gt (len (include "stockade.ruleKey" $path)) 253) -}}
{{- fail (printf "rules.files: %q is not a relative path of letters, digits, '.', '_', '-' and '/' (no segment may start with '.'; flattened, at most 253 characters)" $path) -}}
{{- end -}}
{{- end -}}
{{- if not .Values.vault.address -}}
{{- fail "vault.address is required (the broker reads every credential from Vault/OpenBao)" -}}
{{- end -}}
{{- if and (eq .Values.vault.auth "token") (not .Values.vault.token.secret) -}}
{{- fail "vault.auth is token: set vault.token.secret (a Secret with the key token)" -}}
{{- end -}}
{{- if and (eq .Values.vault.auth "approle") (not .Values.vault.approle.secret) -}}
{{- fail "vault.auth is approle: set vault.approle.secret (a Secret with role-id and secret-id)" -}}
{{- end -}}
{{- $api := .Values.launcher.api -}}
{{- if not $api.tokenSecret -}}
{{- fail "launcher.api.tokenSecret is required: a Secret with the key token, the bearer token of the launcher API (docs/deploy.md \"The launcher API\")" -}}
{{- end -}}
{{- if and (not $api.tlsSecret) (not $api.plaintext) -}}
{{- fail "launcher.api.tlsSecret is empty: give a kubernetes.io/tls Secret for the launcher API, or set launcher.api.plaintext: true to send its token unencrypted" -}}
{{- end -}}
{{- if and $api.clientCertificates (not $api.tlsSecret) -}}
{{- fail "launcher.api.clientCertificates needs launcher.api.tlsSecret (its ca.crt signs the clients' certificates)" -}}
{{- end -}}
{{- if not .Values.pools -}}
{{- fail "pools is empty: at least one node pool runs Stockade" -}}
{{- end -}}
{{- $names := dict -}}
{{- range .Values.pools -}}
{{- if hasKey $names .name -}}
{{- fail (printf "pools: the name %q is used twice" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- if and .kvm (has "microvm" .tiers) (not $.Values.kvmResource) (not $.Values.launcher.privileged) -}}
{{- fail (printf "pools[%s].kvm: an unprivileged launcher gets /dev/kvm only through kvmResource (a device plugin); set it, or launcher.privileged: true" .name) -}}
{{- end -}}
{{- if not (has "container" .tiers) -}}
{{- fail (printf "pools[%s].tiers must include container (the tier every node gives)" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* stockade.yaml of one pool (dict root, pool, component: "launcher" for the launcher's):
     what the chart sets, under the values' `config`. */}}
{{- define "stockade.config" -}}
{{- $pool := .pool -}}
{{- $v := .root.Values -}}
{{- $vault := dict "address" $v.vault.address "auth" $v.vault.auth -}}
{{- if eq $v.vault.auth "kubernetes" -}}
{{- $_ := set $vault "kubernetes" (dict "role" $v.vault.kubernetes.role "mount" $v.vault.kubernetes.mount "token_file" "/var/run/secrets/stockade/vault/token") -}}
{{- else if eq $v.vault.auth "token" -}}
{{- $_ := set $vault "token_file" "/var/run/secrets/stockade/vault/token" -}}
{{- else -}}
{{- $_ := set $vault "approle" (dict "role_id_file" "/var/run/secrets/stockade/vault/role-id" "secret_id_file" "/var/run/secrets/stockade/vault/secret-id" "mount" $v.vault.approle.mount) -}}
{{- end -}}
{{- if $v.vault.caSecret -}}
{{- $_ := set $vault "ca_file" "/var/run/secrets/stockade/vault-ca/ca.crt" -}}
{{- end -}}
{{- $microvm := dict "enabled" (has "microvm" $pool.tiers) "accel" (ternary "kvm" "tcg" (default false $pool.kvm)) -}}
{{- $chart := dict
  "rules_dir" "/etc/stockade/rules"
  "state_dir" "/var/lib/stockade"
  "run_dir" "/run/stockade"
  "log_dir" "/var/log/stockade"
  "events" (dict "file" nil "stdout" true)
  "gateway" (dict
    "transparent_listen" (list (printf "0.0.0.0:%d" (int $v.ports.transparent)))
    "proxy_listen" (list (printf "127.0.0.1:%d" (int $v.ports.proxy)))
    "metrics_listen" (printf "127.0.0.1:%d" (int $v.ports.gatewayMetrics))
    "control_socket" "/run/stockade/gateway.sock"
    "registry_file" "/var/lib/stockade/gateway/tasks.json")
  "dns" (dict "listen" (list (printf "0.0.0.0:%d" (int $v.ports.dns))))
  "broker" (dict
    "listen" (printf "0.0.0.0:%d" (int $v.ports.broker))
    "metrics_listen" (printf "127.0.0.1:%d" (int $v.ports.brokerMetrics))
    "control_socket" "/run/stockade/broker.sock"
    "state_file" "/var/lib/stockade/broker/tasks.json")
  "vault" $vault
  "launcher" (dict
    "control_socket" "/run/stockade/launcher.sock"
    "scratch_dir" "/var/lib/stockade/sandboxes"
    "address_pool" $pool.addressPool
    "gvisor" (dict "enabled" (has "gvisor" $pool.tiers) "root_dir" "/run/stockade/runsc")
    "microvm" $microvm)
-}}
{{- if eq (default "" .component) "launcher" -}}
{{- /* root's files in a directory of their own: a file the root launcher creates (0640)
       in the shared one, or its rotation, would lock the uid-65534 services out of it */ -}}
{{- $_ := set $chart "events" (dict "file" "/var/log/stockade/launcher/events.jsonl" "task_dir" "/var/log/stockade/launcher/tasks" "stdout" true) -}}
{{- $_ := mergeOverwrite $chart.launcher (include "stockade.launcherApi" .root | fromYaml) -}}
{{- end -}}
{{- toYaml (mergeOverwrite (deepCopy $v.config) $chart) -}}
{{- end -}}

{{/* The gateway's and the broker's container security: no capabilities, no root. */}}
{{- define "stockade.unprivileged" -}}
runAsUser: 65534
runAsGroup: 65534
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* What every Stockade container mounts: config, rules, sockets, state, logs, /tmp. */}}
{{- define "stockade.mounts" -}}
- {name: config, mountPath: /etc/stockade/config, readOnly: true}
- {name: rules, mountPath: /etc/stockade/rules, readOnly: true}
- {name: run, mountPath: /run/stockade}
- {name: state, mountPath: /var/lib/stockade}
- {name: logs, mountPath: /var/log/stockade}
- {name: tmp, mountPath: /tmp}
{{- end -}}


{{/* The launcher's TCP listener (its own bearer-token transport), in launcher.yaml only. */}}
{{- define "stockade.launcherApi" -}}
{{- $api := .Values.launcher.api -}}
control_listen: {{ printf "0.0.0.0:%d" (int .Values.ports.launcherApi) | quote }}
{{- /* ..data/token, not token: the launcher opens its token file without following a
       symlink, and the kubelet's projected `token` is a symlink into ..data, the
       directory it swaps atomically on a rotation (which the launcher sees, and reloads) */}}
control_token_file: /var/run/secrets/stockade/launcher-api/..data/token
{{- if $api.tlsSecret }}
control_tls_cert: /var/run/secrets/stockade/launcher-tls/tls.crt
control_tls_key: /var/run/secrets/stockade/launcher-tls/tls.key
{{- if $api.clientCertificates }}
control_tls_client_ca: /var/run/secrets/stockade/launcher-tls/ca.crt
{{- end }}
{{- end }}
{{- end -}}

// Starts `tiermoe serve --port 0` and resolves with its base URL once it prints the port.
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

export const repoRoot = path.resolve(path.dirname(new URL(import.meta.url).pathname), '../..');
export const tinymix = path.join(repoRoot, 'models/tinymix-code');

export function startServer(args, timeoutMs = 60000) {
  const bin = process.env.TIERMOE_BIN || path.join(repoRoot, 'build/tiermoe');
  const proc = spawn(bin, ['serve', '--host', '127.0.0.1', '--port', '0', ...args], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  return new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => { proc.kill('SIGKILL'); reject(new Error('server did not start: ' + out)); }, timeoutMs);
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`server exited (${code}): ${out}`)); });
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[\d.]+:\d+)/);
      if (m) {
        clearTimeout(timer);
        proc.removeAllListeners('exit');
        resolve({
          url: m[1],
          stop: () => new Promise((res) => {
            const kill = setTimeout(() => proc.kill('SIGKILL'), 10000);
            proc.on('exit', (code) => { clearTimeout(kill); res(code); });
            proc.kill('SIGTERM');
          }),
        });
      }
    });
  });
}

// tinymix plus a ChatML chat template (its vocabulary has no <|im_start|> token: the markers
// are tokenized as text; what is tested is the protocol, not chat quality).
export function chatmlModelDir() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tiermoe-chatml-'));
  for (const name of fs.readdirSync(tinymix)) {
    if (name === 'tokenizer_config.json' || name.endsWith('.xz')) continue;
    fs.symlinkSync(path.join(tinymix, name), path.join(dir, name));
  }
  const cfg = JSON.parse(fs.readFileSync(path.join(tinymix, 'tokenizer_config.json'), 'utf8'));
  cfg.chat_template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(cfg, null, 2));
  return dir;
}

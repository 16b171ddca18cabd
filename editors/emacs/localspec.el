;;; localspec.el --- Local speculative completion and rewrites over localspec -*- lexical-binding: t -*-

;; Version: 0.1.0
;; Package-Requires: ((emacs "28.1"))
;; Keywords: tools, convenience
;; URL: docs/editors.md in the localspec repository

;;; Commentary:

;; One `localspec serve --stdio' per Emacs (docs/protocol.md), started on first use and
;; restarted after it dies.  Commands:
;;   `localspec-complete'   fill-in-the-middle at point, shown as an overlay; TAB accepts it,
;;                          C-c C-l (`localspec-accept-line') its first line, typing on drops it.
;;   `localspec-mode'       completes after each pause in typing (`localspec-idle-delay'), and
;;                          reads the buffer ahead when Emacs is idle in it
;;                          (`localspec-prefill-delay'), so the first completion there is warm.
;;   `localspec-rewrite'    rewrite the region as an instruction says, streamed in, one undo
;;                          step; C-g (or `localspec-cancel') stops it and puts the text back.
;;   `localspec-ask'        a question about the buffer, answered in *localspec*.
;; Set-up:
;;   (add-to-list 'load-path "/path/to/localspec/editors/emacs")
;;   (require 'localspec)
;;   (setq localspec-model "default")
;;   (add-hook 'prog-mode-hook #'localspec-mode)

;;; Code:

(require 'json)
(require 'subr-x)

(defgroup localspec nil "Local speculative LLM completion." :group 'tools)
(defcustom localspec-command "localspec" "The localspec executable." :type 'string)
(defcustom localspec-model nil "The -m MODEL argument (nil: the server's default)."
  :type '(choice (const nil) string))
(defcustom localspec-args nil "More `localspec serve' arguments." :type '(repeat string))
(defcustom localspec-idle-delay 0.3 "Seconds of no typing before `localspec-mode' completes."
  :type 'number)
(defcustom localspec-max-tokens 64 "Tokens per completion at most." :type 'integer)
(defcustom localspec-max-lines 8 "Lines per completion at most." :type 'integer)
(defcustom localspec-time-budget-ms 2000
  "Past this, a completion ends at its next line end (0: off)." :type 'integer)
(defcustom localspec-prefix-lines 256 "Lines before point sent with a completion." :type 'integer)
(defcustom localspec-suffix-lines 64 "Lines after point sent with a completion." :type 'integer)
(defcustom localspec-prefill-delay 1.0
  "Idle seconds before `localspec-mode' reads the buffer ahead (nil: never).
The server then holds the buffer, and the first completion typed in it is warm."
  :type '(choice (const nil) number))
(defcustom localspec-rewrite-max-tokens nil
  "Tokens per rewrite at most (nil: room for the text twice over)."
  :type '(choice (const nil) integer))

(defvar localspec--process nil)
(defvar localspec--partial "")
(defvar localspec--next-id 0)
(defvar localspec--pending (make-hash-table :test 'eql))
(defvar localspec--stderr nil "The server's last stderr lines, newest first.")
(defvar localspec--overlay nil)
(defvar localspec--completion-id nil)
(defvar localspec--timer nil)
(defvar localspec--prefill-timer nil)
(defvar localspec--prefilled nil "What the last prefill was for: (buffer tick line).")
(defvar localspec-last-prefill nil "The result of the last prefill.")
(defvar localspec-last-stats nil "Statistics of the last finished request.")
(defvar localspec-last-result nil "The text of the last finished rewrite.")
(defvar-local localspec--noted nil "This buffer's cut to the context was reported.")

(defun localspec--message (fmt &rest args)
  (message "localspec: %s" (apply #'format fmt args)))

;;;; The server

(defun localspec--dispatch (msg)
  (let* ((method (alist-get 'method msg))
         (id (if method (alist-get 'id (alist-get 'params msg)) (alist-get 'id msg)))
         (handlers (and id (gethash id localspec--pending))))
    (cond
     ((equal method "generate/progress")
      (when-let ((f (plist-get handlers :progress)))
        (funcall f (alist-get 'text (alist-get 'params msg)))))
     ((null handlers)
      (when-let ((err (alist-get 'error msg)))
        (localspec--message "%s" (alist-get 'message err))))
     (t
      (remhash id localspec--pending)
      (if-let ((err (alist-get 'error msg)))
          (funcall (or (plist-get handlers :error)
                       (lambda (m) (localspec--message "%s" m)))
                   (alist-get 'message err))
        (when-let ((f (plist-get handlers :done)))
          (funcall f (alist-get 'result msg))))))))

(defun localspec--filter (_proc output)
  (setq localspec--partial (concat localspec--partial output))
  (let ((lines (split-string localspec--partial "\n")))
    (setq localspec--partial (car (last lines)))
    (dolist (line (butlast lines))
      (unless (string-empty-p line)
        (let ((msg (condition-case nil
                       (json-parse-string line :object-type 'alist :null-object nil
                                          :false-object nil)
                     (error nil))))
          (when msg
            (condition-case err (localspec--dispatch msg)
              (error (localspec--message "%s" (error-message-string err))))))))))

(defun localspec--stderr-filter (_proc output)
  (dolist (line (split-string output "\n" t))
    (push line localspec--stderr))
  (setq localspec--stderr (seq-take localspec--stderr 20)))

(defun localspec--sentinel (proc _event)
  (unless (process-live-p proc)
    (setq localspec--process nil localspec--partial "")
    (let ((pending localspec--pending))
      (setq localspec--pending (make-hash-table :test 'eql))
      (maphash (lambda (_id h) (when-let ((f (plist-get h :error)))
                                 (funcall f "the server stopped")))
               pending))
    (unless (or (zerop (process-exit-status proc)) (process-get proc 'localspec-stopped))
      (localspec--message "the server stopped: %s (it restarts on the next command)"
                          (or (car localspec--stderr)
                              (format "exit status %d" (process-exit-status proc)))))))

(defun localspec-server ()
  "The running server process, started when there is none.
nil, with a message, when it cannot start."
  (or (and (process-live-p localspec--process) localspec--process)
      (if (not (executable-find localspec-command))
          (progn (localspec--message
                  "cannot start the server: the executable `%s' was not found; install \
localspec or set `localspec-command'" localspec-command)
                 nil)
        (setq localspec--stderr nil localspec--partial "")
        (setq localspec--process
              (make-process
               :name "localspec" :buffer nil :noquery t :connection-type 'pipe
               :coding 'utf-8-unix
               :command (append (list localspec-command "serve" "--stdio")
                                (and localspec-model (list "-m" localspec-model))
                                localspec-args)
               :filter #'localspec--filter :sentinel #'localspec--sentinel
               :stderr (make-pipe-process :name "localspec-stderr" :noquery t
                                          :filter #'localspec--stderr-filter))))))

(defun localspec-request (method params &rest handlers)
  "Send METHOD with PARAMS (an alist); return the request id.
HANDLERS are :progress, :done and :error functions."
  (when-let ((proc (localspec-server)))
    (let ((id (setq localspec--next-id (1+ localspec--next-id))))
      (puthash id handlers localspec--pending)
      (process-send-string
       proc (concat (json-serialize `((jsonrpc . "2.0") (id . ,id) (method . ,method)
                                      (params . ,params)))
                    "\n"))
      id)))

(defun localspec-cancel-request (id)
  (when (and id (process-live-p localspec--process) (gethash id localspec--pending))
    (process-send-string localspec--process
                         (concat (json-serialize `((jsonrpc . "2.0") (method . "cancel")
                                                   (params . ((id . ,id)))))
                                 "\n"))))

(defun localspec-stop ()
  "Stop the server."
  (interactive)
  (when (process-live-p localspec--process)
    (process-put localspec--process 'localspec-stopped t)
    (delete-process localspec--process)))

;;;; Completion at point

(defvar localspec-completion-map
  (let ((map (make-sparse-keymap)))
    (define-key map (kbd "TAB") #'localspec-accept)
    (define-key map (kbd "<tab>") #'localspec-accept)
    (define-key map (kbd "C-c C-l") #'localspec-accept-line)
    map)
  "Active while a completion is shown.")

(defun localspec-clear ()
  "Remove the completion overlay."
  (interactive)
  (when localspec--overlay (delete-overlay localspec--overlay))
  (setq localspec--overlay nil))

(defun localspec-completion-text ()
  "The completion shown at point, or nil."
  (and localspec--overlay (overlay-get localspec--overlay 'localspec-text)))

(defun localspec--show (text)
  (localspec-clear)
  (unless (string-empty-p text)
    (let ((ov (make-overlay (point) (point) nil t nil)))
      (overlay-put ov 'after-string (propertize text 'face 'shadow 'cursor 0))
      (overlay-put ov 'localspec-text text)
      (overlay-put ov 'priority 100)
      (setq localspec--overlay ov)
      (set-transient-map localspec-completion-map
                         (lambda () (and localspec--overlay
                                         (eq (overlay-buffer localspec--overlay)
                                             (current-buffer))))))))

(defun localspec--lines (from count forward)
  "Point of the line COUNT lines from FROM, FORWARD or back."
  (save-excursion (goto-char from) (forward-line (if forward count (- count))) (point)))

(defun localspec--params ()
  "The `complete' params for point.
Lines are what \\n separates, as Emacs and the server count them."
  (let* ((pt (point)) (indent (current-indentation))
         (prefix (buffer-substring-no-properties
                  (localspec--lines (line-beginning-position) localspec-prefix-lines nil) pt))
         (suffix (buffer-substring-no-properties
                  pt (save-excursion (goto-char pt) (forward-line localspec-suffix-lines)
                                     (line-end-position)))))
    `((prefix . ,prefix) (suffix . ,suffix)
      (filename . ,(if buffer-file-name (file-name-nondirectory buffer-file-name)
                     (buffer-name)))
      (max_tokens . ,localspec-max-tokens) (max_lines . ,localspec-max-lines)
      (time_budget_ms . ,localspec-time-budget-ms)
      ,@(and (> indent 0) `((min_indent . ,indent))))))

(defun localspec-prefill ()
  "Read the buffer ahead at point, so that the first completion here is warm.
Sent once per buffer state and line; `localspec-mode' calls it when idle."
  (interactive)
  (let ((key (list (current-buffer) (buffer-chars-modified-tick) (line-number-at-pos))))
    (unless (equal key localspec--prefilled)
      (setq localspec--prefilled key)
      (localspec-request "prefill" (localspec--params)
                         :done (lambda (r) (setq localspec-last-prefill r))
                         :error #'ignore))))     ; no FIM tokens: completion will say so

(defvar localspec-mode)

(defun localspec--idle-prefill ()
  (when (and localspec-mode (not buffer-read-only)) (localspec-prefill)))

(defun localspec-complete ()
  "Ask for a completion at point; it shows as an overlay when it arrives."
  (interactive)
  (let* ((buf (current-buffer)) (pt (point)) (tick (buffer-chars-modified-tick)))
    (localspec-clear)
    (setq localspec--completion-id
          (localspec-request
           "complete"
           (append (localspec--params) '((stream . :false)))
           :done (lambda (r)
                   (setq localspec-last-stats (alist-get 'stats r))
                   (when (and (alist-get 'truncated r) (buffer-live-p buf)
                              (not (buffer-local-value 'localspec--noted buf)))
                     (with-current-buffer buf (setq localspec--noted t))
                     (localspec--message "%s" (alist-get 'note r)))
                   (when (and (buffer-live-p buf) (eq (current-buffer) buf) (= (point) pt)
                              (= (buffer-chars-modified-tick) tick))
                     (localspec--show (alist-get 'text r))))
           :error (lambda (m) (localspec--message "%s" m))))))

(defun localspec-accept (&optional first-line-only)
  "Insert the completion shown at point (only its first line with FIRST-LINE-ONLY)."
  (interactive)
  (let ((text (localspec-completion-text)))
    (if (not text)
        (indent-for-tab-command)
      (localspec-clear)
      (insert (if first-line-only (car (split-string text "\n")) text)))))

(defun localspec-accept-line ()
  "Insert the first line of the completion shown at point."
  (interactive)
  (localspec-accept t))

(defun localspec--after-change (&rest _)
  (when localspec--overlay (localspec-clear))
  (when localspec--completion-id (localspec-cancel-request localspec--completion-id))
  (when localspec--timer (cancel-timer localspec--timer))
  (setq localspec--timer
        (run-with-idle-timer localspec-idle-delay nil
                             (let ((buf (current-buffer)))
                               (lambda () (when (eq (current-buffer) buf)
                                            (localspec-complete)))))))

;;;###autoload
(define-minor-mode localspec-mode
  "Complete at point with localspec after each pause in typing."
  :lighter " LS"
  (if localspec-mode
      (progn
        (add-hook 'after-change-functions #'localspec--after-change nil t)
        (when (and localspec-prefill-delay (not localspec--prefill-timer))
          (setq localspec--prefill-timer
                (run-with-idle-timer localspec-prefill-delay t #'localspec--idle-prefill))))
    (remove-hook 'after-change-functions #'localspec--after-change t)
    (localspec-clear)))

;;;; Rewrite and ask

(defvar localspec--rewrite nil "The running rewrite: a plist.")

(defvar localspec-rewrite-map
  (let ((map (make-sparse-keymap)))
    (define-key map (kbd "C-g") #'localspec-cancel)
    map)
  "Active while a rewrite runs: C-g cancels it.")

(defun localspec--replace (state text)
  "Put TEXT in STATE's range of its buffer, one undo step with what came before."
  (with-current-buffer (plist-get state :buffer)
    (let ((inhibit-read-only t))
      (save-excursion
        (delete-region (plist-get state :beg) (plist-get state :end))
        (goto-char (plist-get state :beg))
        (insert text)
        (set-marker (plist-get state :end) (point))))))

(defun localspec-rewrite (beg end instruction)
  "Rewrite the lines from BEG to END as INSTRUCTION says, streamed in.
C-g cancels it and puts the text back.  Emacs stays usable meanwhile."
  (interactive
   (if (use-region-p)
       (list (region-beginning) (region-end) (read-string "Rewrite how? "))
     (user-error "localspec: select the text to rewrite first")))
  (when localspec--rewrite (user-error "localspec: a rewrite is already running"))
  (let* ((beg (save-excursion (goto-char beg) (line-beginning-position)))
         (end (save-excursion (goto-char end)
                              (if (and (bolp) (> end beg)) (point)
                                (min (point-max) (1+ (line-end-position))))))
         (l1 (line-number-at-pos beg)) (l2 (line-number-at-pos (max beg (1- end))))
         (original (buffer-substring-no-properties beg end))
         (text (buffer-substring-no-properties (point-min) (point-max)))
         (state (list :buffer (current-buffer) :beg (copy-marker beg)
                      :end (copy-marker end t) :original original :text ""
                      :undo (prepare-change-group))))
    (activate-change-group (plist-get state :undo))
    (setq localspec--rewrite state)
    (let ((id (localspec-request
               "rewrite"
               `((text . ,(if (string-suffix-p "\n" text) text (concat text "\n")))
                 (instruction . ,instruction) (region . [,l1 ,l2])
                 (filename . ,(if buffer-file-name (file-name-nondirectory buffer-file-name)
                                (buffer-name)))
                 ,@(and localspec-rewrite-max-tokens
                        `((max_tokens . ,localspec-rewrite-max-tokens))))
               :progress (lambda (piece)
                           (plist-put state :text (concat (plist-get state :text) piece))
                           (localspec--replace state (plist-get state :text)))
               :done (lambda (r)
                       (setq localspec--rewrite nil localspec-last-result (alist-get 'text r)
                             localspec-last-stats (alist-get 'stats r))
                       (localspec--replace state (alist-get 'text r))
                       (undo-amalgamate-change-group (plist-get state :undo))
                       (accept-change-group (plist-get state :undo))
                       (let ((st (alist-get 'stats r)))
                         (localspec--message "rewrote %d lines: %d tokens, %.1f tok/s, %d/%d \
drafts accepted" (1+ (- l2 l1)) (alist-get 'generated_tokens st)
                                             (alist-get 'decode_tokens_per_s st)
                                             (alist-get 'accepted st) (alist-get 'drafted st))))
               :error (lambda (m)
                        (setq localspec--rewrite nil)
                        (localspec--replace state original)
                        (undo-amalgamate-change-group (plist-get state :undo))
                        (accept-change-group (plist-get state :undo))
                        (if (plist-get state :cancelled)
                            (localspec--message "rewrite cancelled; the text is as it was")
                          (localspec--message "%s" m))))))
      (if (not id)
          (progn (setq localspec--rewrite nil)
                 (cancel-change-group (plist-get state :undo)))
        (plist-put state :id id)
        (set-transient-map localspec-rewrite-map (lambda () localspec--rewrite))))))

(defun localspec-cancel ()
  "Cancel the running rewrite (its text is put back) and any completion."
  (interactive)
  (when localspec--rewrite
    (plist-put localspec--rewrite :cancelled t)
    (localspec-cancel-request (plist-get localspec--rewrite :id)))
  (when localspec--completion-id (localspec-cancel-request localspec--completion-id))
  (localspec-clear))

(defun localspec-ask (question)
  "Ask QUESTION about the current buffer; the answer streams into *localspec*."
  (interactive "sAsk about this buffer: ")
  (let* ((text (buffer-substring-no-properties (point-min) (point-max)))
         (out (get-buffer-create "*localspec*")))
    (with-current-buffer out (let ((inhibit-read-only t)) (erase-buffer)))
    (display-buffer out)
    (localspec-request
     "generate"
     `((messages . [((role . "user")
                     (content . ,(format "File %s:\n%s\n\n%s" (buffer-name) text question)))])
       (document . ,text) (max_tokens . 512))
     :progress (lambda (piece) (with-current-buffer out
                                 (let ((inhibit-read-only t))
                                   (goto-char (point-max)) (insert piece))))
     :done (lambda (r) (setq localspec-last-stats (alist-get 'stats r))))))

(defun localspec-stats ()
  "Show the statistics of the last finished request."
  (interactive)
  (let ((st localspec-last-stats))
    (if (not st) (localspec--message "no request has finished yet")
      (localspec--message "%d tokens, %.1f tok/s, prompt %d (%d reused), %d/%d drafts accepted"
                          (alist-get 'generated_tokens st) (alist-get 'decode_tokens_per_s st)
                          (alist-get 'prompt_tokens st) (alist-get 'reused_tokens st)
                          (alist-get 'accepted st) (alist-get 'drafted st)))))

(provide 'localspec)
;;; localspec.el ends here
